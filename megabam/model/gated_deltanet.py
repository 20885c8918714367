"""The Gated DeltaNet mixer (arXiv 2412.06464) around the cell of kernels/gated_deltanet.py.

Projections, short causal convolutions, the decay and rate gates per head, the cell, and a gated
per-head norm. Training and multi-token streaming run the chunkwise form, generation of one token at
a time the recurrent one, through the dispatch point (kernels/dispatch.py: fla's kernels on CUDA
tensors, the PyTorch forms on CPU). Like the mLSTM, the layer ignores document boundaries (the state runs
across packed documents).
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megabam.config.schema import ModelConfig
from megabam.kernels import dispatch
from megabam.kernels.precision import compute_dtype
from megabam.model.layers import SequenceInfo, head_rms_norm
from megabam.model.registry import register_mixer
from megabam.model.sharding import TensorParallelPlan


class GatedDeltaNetState(NamedTuple):
    """S (B, H, d_k, d_v) and the last conv_size - 1 inputs of the short convolutions (B, K-1, 3d)."""

    S: Tensor
    conv: Tensor


class GatedDeltaNet(nn.Module):
    """q, k, v projections through short causal depthwise convolutions and SiLU; L2-normalised q, k;
    decay g = −exp(A)·softplus(a(x) + dt_bias) ≤ 0 and β = σ(b(x)) per head; the cell; per-head RMS
    norm gated by SiLU(gate(x)); output projection. Per-head tensors keep the head dimension first."""

    kernel_calls = ("cell",)  # the methods that call a kernel (megabam/parallel/compile.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c, d = cfg.gated_deltanet, cfg.d_model
        n_heads = c.n_heads or cfg.n_heads
        self.head_dim = d // n_heads
        self.chunk_size, self.conv_size, self.norm_eps = c.chunk_size, c.conv_size, cfg.norm_eps
        self.backend = cfg.kernels
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.conv = nn.Conv1d(3 * d, 3 * d, c.conv_size, groups=3 * d, bias=False)
        self.a = nn.Linear(d, n_heads, bias=False)
        self.b = nn.Linear(d, n_heads, bias=False)
        # Decay rates spread over heads: A in [1, 16], softplus(dt_bias) in [1e-3, 0.1] (the paper's ranges,
        # set evenly rather than drawn, so heads start with time scales from ~1 to ~1000 steps).
        self.A_log = nn.Parameter(torch.linspace(1.0, 16.0, n_heads).log())
        dt = torch.exp(torch.linspace(math.log(1e-3), math.log(0.1), n_heads))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
        self.gate = nn.Linear(d, d, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(n_heads * self.head_dim))  # head-major
        self.out = nn.Linear(d, d, bias=False)
        # Where x enters the four projections that read it: the identity here; tensor parallelism
        # makes it the one collective they share (the plan's entry).
        self.enter = nn.Identity()

    @property
    def n_heads(self) -> int:
        """Heads this module holds (all, or this rank's under tensor parallelism): one decay rate each."""
        return self.a.weight.shape[0]

    def tp_plan(self) -> TensorParallelPlan:
        """Whole heads per rank: the local heads' q, k, v rows and convolution channels, gates, decay
        parameters and norm weight, behind one shared entry, and the rows of the output projection."""
        return TensorParallelPlan(
            column={"qkv": 3, "a": 1, "b": 1, "gate": 1},
            channels={"conv": 3},
            row=("out",),
            heads=("A_log", "dt_bias", "norm_weight"),
            entry="enter",
            head_counts={"Gated DeltaNet": self.n_heads},
        )

    def cell_inputs(self, x: Tensor, conv_cache: Tensor | None) -> tuple[tuple[Tensor, ...], Tensor]:
        """(q, k, v (B, H, N, D), g, β (B, H, N)) and the new convolution cache."""
        B, N, _ = x.shape
        qkv = self.qkv(x)
        if conv_cache is None:
            conv_cache = qkv.new_zeros(B, self.conv_size - 1, qkv.shape[-1])
        padded = torch.cat([conv_cache, qkv], dim=1)
        qkv = F.silu(self.conv(padded.transpose(1, 2)).transpose(1, 2))
        q, k, v = (t.view(B, N, self.n_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        g = (-torch.exp(self.A_log) * F.softplus(self.a(x) + self.dt_bias)).transpose(1, 2)
        beta = torch.sigmoid(self.b(x)).transpose(1, 2)
        return (q, k, v, g, beta), padded[:, padded.shape[1] - (self.conv_size - 1) :]

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        B, N, _ = x.shape
        o = head_rms_norm(o, self.norm_weight, self.norm_eps).transpose(1, 2).reshape(B, N, -1)
        return self.out(F.silu(self.gate(x)) * o)

    def forward(self, x: Tensor, seq: SequenceInfo) -> Tensor:
        return self.stream(x, None, seq)[0]

    def stream(
        self, x: Tensor, state: GatedDeltaNetState | None, seq: SequenceInfo
    ) -> tuple[Tensor, GatedDeltaNetState]:
        """Continue from `state` (None = start) over x (B, N, d); returns (output, state after the last
        step). Several steps run the chunkwise form, a single step (generation) the recurrent one."""
        x = self.enter(x)
        (q, k, v, g, beta), conv = self.cell_inputs(x, None if state is None else state.conv)
        g, beta = g.to(compute_dtype(x)), beta.to(compute_dtype(x))  # the dispatch point casts q, k, v
        S = None if state is None else state.S
        o, S = self.cell(q, k, v, g, beta, S)
        return self._output(x, o.to(x.dtype)), GatedDeltaNetState(S, conv)

    def cell(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor | None):
        """The cell on the op the dispatch point picks (it casts q, k, v for that op); a compiled block
        runs it outside its graphs (megabam/parallel/compile.py)."""
        return dispatch.gated_delta(q, k, v, g, beta, self.chunk_size, S, backend=self.backend)

    def mixing_flops(self, seq_len: int, window: int | None = None, causal: bool = True) -> dict[str, float]:
        """Forward FLOPs per token of the chunkwise cell: within a chunk k·k, q·k, the triangular solve
        and scores·U over half a chunk on average (causal=False: the whole chunk, the masked triangle
        counted); between chunks k·S, q·S and the state update."""
        chunk, D = min(self.chunk_size, seq_len), self.head_dim
        keys = chunk / 2 if causal else chunk
        return {"intra_chunk": float(8 * self.n_heads * keys * D), "inter_chunk": float(6 * self.n_heads * D * D)}


@register_mixer("gated_deltanet")
def build_gated_deltanet(cfg: ModelConfig, shared: dict) -> GatedDeltaNet:
    return GatedDeltaNet(cfg)
