"""The mLSTM mixer (xLSTM-7B form) around the cell of kernels/mlstm.py.

The cell's equations and its three equivalent forms (parallel, chunkwise, recurrent) are documented
there. Training and multi-token streaming run the chunkwise form through the dispatch point
(kernels/dispatch.py: the Triton kernel on CUDA tensors, the PyTorch form on CPU), generation of one
token at a time the recurrent form.

Recurrent layers ignore document boundaries: the state runs across packed documents, as in the SWAX
paper's pretraining, and the forget gate learns to clear it.
"""
from typing import Optional

import torch
from torch import Tensor, nn

from kernels import dispatch
from kernels.mlstm import MLstmState, mlstm_recurrent
from megabam.config.schema import ModelConfig
from megabam.model.attention import SequenceInfo


def compute_dtype(x: Tensor) -> torch.dtype:
    """Recurrent cells run in fp32 under bf16/fp16 training (exponential gates and long sums), fp64 for fp64."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def head_rms_norm(h: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMS norm of each head's vector: h (B, H, N, D); weight (H·D,) head-major (head h owns
    weight[h·D:(h+1)·D], so it shards by heads; kept 1-D so the optimizer leaves it undecayed like every norm)."""
    h32 = h.float()
    y = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float().view(h.shape[1], 1, h.shape[-1])).type_as(h)


class MLstm(nn.Module):
    """q, k projected to d/2 and v to d, split into heads; per-head scalar input and forget gates
    (soft-capped); the cell; per-head RMS norm; output gate σ(o) ⊙ h; output projection.

    Per-head tensors (gate weights (H, d) and biases (H,), the head-major norm weight (H·d_v,)) keep
    the head dimension first so tensor parallelism can shard them by heads.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c, d = cfg.mlstm, cfg.d_model
        self.n_heads = c.n_heads or cfg.n_heads
        self.qk_dim, self.v_dim = d // 2 // self.n_heads, d // self.n_heads
        self.chunk_size, self.soft_cap, self.eps, self.norm_eps = c.chunk_size, c.gate_soft_cap, c.eps, cfg.norm_eps
        self.kernels = cfg.kernels
        # Where x enters the six projections that read it: the identity here; tensor parallelism makes
        # it the one collective they share (megabam/parallel/tensor_parallel.py).
        self.enter = nn.Identity()
        self.q = nn.Linear(d, d // 2, bias=False)
        self.k = nn.Linear(d, d // 2, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.igate = nn.Linear(d, self.n_heads)
        self.fgate = nn.Linear(d, self.n_heads)
        self.ogate = nn.Linear(d, d, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(self.n_heads * self.v_dim))
        self.out = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.igate.bias.fill_(c.igate_bias_init)
            self.fgate.bias.copy_(torch.linspace(c.fgate_bias_init[0], c.fgate_bias_init[1], self.n_heads))

    def _heads(self, x: Tensor, dim: int) -> Tensor:
        B, N, _ = x.shape
        return x.view(B, N, self.n_heads, dim).transpose(1, 2)

    def _inputs(self, x: Tensor) -> tuple[Tensor, ...]:
        """q, k, v as (B, H, N, ·) and the soft-capped gate pre-activations i, f as (B, H, N)."""
        cap = self.soft_cap
        i = (cap * torch.tanh(self.igate(x) / cap)).transpose(1, 2)
        f = (cap * torch.tanh(self.fgate(x) / cap)).transpose(1, 2)
        return (self._heads(self.q(x), self.qk_dim), self._heads(self.k(x), self.qk_dim),
                self._heads(self.v(x), self.v_dim), i, f)

    def _output(self, x: Tensor, h: Tensor) -> Tensor:
        B, N, _ = x.shape
        h = head_rms_norm(h, self.norm_weight, self.norm_eps).transpose(1, 2).reshape(B, N, -1)
        return self.out(torch.sigmoid(self.ogate(x)) * h)

    def forward(self, x: Tensor, seq: SequenceInfo) -> Tensor:
        return self.stream(x, None, seq)[0]

    def stream(self, x: Tensor, state: Optional[MLstmState], seq: SequenceInfo) -> tuple[Tensor, MLstmState]:
        """Continue from `state` (None = start) over x (B, N, d); returns (output, state after the last
        step). Several steps run the chunkwise form on the op the dispatch point picks (the Triton kernel
        on CUDA tensors), a single step (generation) the recurrent one."""
        x = self.enter(x)
        inputs = [t.to(compute_dtype(x)) for t in self._inputs(x)]
        if x.shape[1] == 1:
            h, state = mlstm_recurrent(*inputs, self.eps, state)
        else:
            h, state = dispatch.mlstm_chunkwise(*inputs, self.eps, self.chunk_size, state, kernels=self.kernels)
        return self._output(x, h.to(x.dtype)), state

    def flops_per_token(self, seq_len: int) -> float:
        """Forward+backward FLOPs per token of the chunkwise cell (projections count as parameters):
        q·k and scores·v over half a chunk on average, q·C and the state update once per step."""
        chunk = min(self.chunk_size, seq_len)
        per_head = chunk * (self.qk_dim + self.v_dim) + 4 * self.qk_dim * self.v_dim
        return 3 * self.n_heads * per_head


def build_mlstm(cfg: ModelConfig, shared: dict) -> MLstm:
    return MLstm(cfg)
