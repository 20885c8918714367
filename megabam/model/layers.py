"""Blocks shared by every mixer: RMS normalisation (whole vectors and per head) and the SwiGLU MLP."""

import torch
import torch.nn.functional as F
from torch import nn

from megabam.model.sharding import TensorParallelPlan


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) · weight over the last dimension (a function so sequence parallelism can pass a
    weight wrapped for its gradient all-reduce)."""
    # Normalise in fp32: bf16 sums of squares lose too much precision at large widths.
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).type_as(x)


def head_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of each head's vector: h (B, H, N, D); weight (H·D,) head-major (head h owns
    weight[h·D:(h+1)·D], so it shards by heads; kept 1-D so the optimizer leaves it undecayed like every norm)."""
    return rms_norm(h, weight.view(h.shape[1], 1, h.shape[-1]), eps)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def tp_plan(self) -> TensorParallelPlan:
        """The same hidden units of both halves of [gate | up] per rank, and their rows of `down`."""
        return TensorParallelPlan(column={"gate_up": 2}, row=("down",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
