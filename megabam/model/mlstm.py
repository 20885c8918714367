"""The mLSTM mixer (xLSTM-7B form, by default with a short convolution on q and k as the original
xLSTM block has: docs/results.md "MQAR" shows why) around the cell of kernels/mlstm.py.

The cell's equations and its three equivalent forms (parallel, chunkwise, recurrent) are documented
there. Training and multi-token streaming run the chunkwise form through the dispatch point
(kernels/dispatch.py: TFLA's or megabam's Triton kernel on CUDA tensors, the PyTorch form on CPU),
generation of one token at a time the recurrent form (TFLA's step kernel on CUDA where it runs).

Recurrent layers ignore document boundaries: the state runs across packed documents, as in the SWAX
paper's pretraining, and the forget gate learns to clear it.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megabam.config.schema import ModelConfig
from megabam.kernels import dispatch
from megabam.kernels.mlstm import MLstmState
from megabam.kernels.precision import compute_dtype
from megabam.model.layers import SequenceInfo, head_rms_norm
from megabam.model.registry import register_mixer
from megabam.model.sharding import TensorParallelPlan


class MLstmLayerState(NamedTuple):
    """What an mLSTM layer carries between calls: the cell's state, and the last conv_size − 1 q, k
    projections (B, K − 1, 2·qk) the convolution reads (None without one)."""

    cell: MLstmState
    conv: Tensor | None


class MLstm(nn.Module):
    """q, k projected to d·mlstm.qk_dim_factor (xLSTM-7B: d/2) and v to d, split into heads; q and k
    optionally through a short causal depthwise convolution and SiLU (mlstm.conv_size); per-head
    scalar input and forget gates (soft-capped); the cell; per-head RMS norm (or layer norm,
    mlstm.head_norm); output gate σ(o) ⊙ h; output projection.

    Per-head tensors (gate weights (H, d) and biases (H,), the head-major norm weight (H·d_v,)) keep
    the head dimension first so tensor parallelism can shard them by heads.
    """

    kernel_calls = ("cell",)  # the methods that call a kernel (megabam/parallel/compile.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c, d = cfg.mlstm, cfg.d_model
        n_heads = c.n_heads or cfg.n_heads
        qk = round(d * c.qk_dim_factor)
        self.qk_dim, self.v_dim = qk // n_heads, d // n_heads
        self.chunk_size, self.soft_cap, self.eps, self.norm_eps = c.chunk_size, c.gate_soft_cap, c.eps, cfg.norm_eps
        self.centred = c.head_norm == "layer"
        self.backend = cfg.kernels
        # Where x enters the six projections that read it: the identity here; tensor parallelism makes
        # it the one collective they share (the plan's entry).
        self.enter = nn.Identity()
        self.q = nn.Linear(d, qk, bias=False)
        self.k = nn.Linear(d, qk, bias=False)
        # A key is most useful as the token before its value: the convolution hands each step its
        # predecessors, which a layer without one must first learn to carry in its state.
        self.conv_size = c.conv_size
        self.conv = nn.Conv1d(2 * qk, 2 * qk, c.conv_size, groups=2 * qk, bias=False) if c.conv_size else None
        self.v = nn.Linear(d, d, bias=False)
        self.igate = nn.Linear(d, n_heads)
        self.fgate = nn.Linear(d, n_heads)
        self.ogate = nn.Linear(d, d, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(n_heads * self.v_dim))
        self.out = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.igate.bias.fill_(c.igate_bias_init)
            self.fgate.bias.copy_(torch.linspace(c.fgate_bias_init[0], c.fgate_bias_init[1], n_heads))

    @property
    def n_heads(self) -> int:
        """Heads this module holds (all, or this rank's under tensor parallelism): one input gate each."""
        return self.igate.weight.shape[0]

    def tp_plan(self) -> TensorParallelPlan:
        """Whole heads per rank: every projection's head slice behind one shared entry, the head-major
        norm weight, and the matching rows of the output projection."""
        return TensorParallelPlan(
            column={name: 1 for name in ("q", "k", "v", "igate", "fgate", "ogate")},
            channels={"conv": 2} if self.conv is not None else {},
            row=("out",),
            heads=("norm_weight",),
            entry="enter",
            head_counts={"mLSTM": self.n_heads},
        )

    def _heads(self, x: Tensor, dim: int) -> Tensor:
        B, N, _ = x.shape
        return x.view(B, N, self.n_heads, dim).transpose(1, 2)

    def cell_inputs(self, x: Tensor, conv_cache: Tensor | None = None) -> tuple[tuple[Tensor, ...], Tensor | None]:
        """(q, k, v as (B, H, N, ·), the soft-capped gate pre-activations i, f as (B, H, N)) and the
        convolution's new cache (None without a convolution)."""
        cap = self.soft_cap
        i = (cap * torch.tanh(self.igate(x) / cap)).transpose(1, 2)
        f = (cap * torch.tanh(self.fgate(x) / cap)).transpose(1, 2)
        q, k = self.q(x), self.k(x)
        if self.conv is not None:
            qk = torch.cat([q, k], dim=-1)
            if conv_cache is None:
                conv_cache = qk.new_zeros(x.shape[0], self.conv_size - 1, qk.shape[-1])
            padded = torch.cat([conv_cache, qk], dim=1)
            q, k = F.silu(self.conv(padded.transpose(1, 2)).transpose(1, 2)).chunk(2, dim=-1)
            conv_cache = padded[:, padded.shape[1] - (self.conv_size - 1) :]
        heads = (self._heads(q, self.qk_dim), self._heads(k, self.qk_dim), self._heads(self.v(x), self.v_dim))
        return (*heads, i, f), conv_cache

    def _output(self, x: Tensor, h: Tensor) -> Tensor:
        B, N, _ = x.shape
        if self.centred:  # a layer norm without bias is the RMS norm of the mean-centred vector
            h = h - h.mean(-1, keepdim=True)
        h = head_rms_norm(h, self.norm_weight, self.norm_eps).transpose(1, 2).reshape(B, N, -1)
        return self.out(torch.sigmoid(self.ogate(x)) * h)

    def forward(self, x: Tensor, seq: SequenceInfo) -> Tensor:
        return self.stream(x, None, seq)[0]

    def stream(self, x: Tensor, state: MLstmLayerState | None, seq: SequenceInfo) -> tuple[Tensor, MLstmLayerState]:
        """Continue from `state` (None = start) over x (B, N, d); returns (output, state after the last
        step). Several steps run the chunkwise form on the op the dispatch point picks (the Triton kernel
        on CUDA tensors), a single step (generation) the recurrent one."""
        x = self.enter(x)
        (q, k, v, i, f), conv = self.cell_inputs(x, None if state is None else state.conv)
        cell = None if state is None else state.cell
        i, f = i.to(compute_dtype(x)), f.to(compute_dtype(x))
        if x.shape[1] == 1:  # the dispatch points cast q, k, v for the op they pick
            h, cell = dispatch.mlstm_steps(q, k, v, i, f, self.eps, cell, backend=self.backend)
        else:
            h, cell = self.cell(q, k, v, i, f, cell)
        return self._output(x, h.to(x.dtype)), MLstmLayerState(cell, conv)

    def cell(self, q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, state: MLstmState | None):
        """The chunkwise cell on the op the dispatch point picks (it casts q, k, v for that op); a
        compiled block runs it outside its graphs (megabam/parallel/compile.py)."""
        return dispatch.mlstm_chunkwise(q, k, v, i, f, self.eps, self.chunk_size, state, backend=self.backend)

    def mixing_flops(self, seq_len: int, window: int | None = None, causal: bool = True) -> dict[str, float]:
        """Forward FLOPs per token of the chunkwise cell (the projections count as parameters): within
        a chunk q·k and scores·v over half a chunk on average (causal=False: the whole chunk, the
        masked triangle counted); between chunks q·C and the state update k·vᵀ once per token."""
        chunk = min(self.chunk_size, seq_len)
        keys = chunk / 2 if causal else chunk
        return {
            "intra_chunk": float(2 * self.n_heads * keys * (self.qk_dim + self.v_dim)),
            "inter_chunk": float(4 * self.n_heads * self.qk_dim * self.v_dim),
        }


@register_mixer("mlstm")
def build_mlstm(cfg: ModelConfig, shared: dict) -> MLstm:
    return MLstm(cfg)
