"""Blocks shared by every mixer: RMSNorm and the SwiGLU MLP."""
import torch
import torch.nn.functional as F
from torch import nn


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


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def swiglu_hidden(d_model: int) -> int:
    """8/3·d (keeps the parameter count of a 4·d GELU MLP), rounded up to a multiple of 64."""
    return -(-(8 * d_model // 3) // 64) * 64
