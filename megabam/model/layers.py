"""What every mixer shares: the batch's sequence information, RMS normalisation (whole vectors and per
head) and the SwiGLU MLP."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megabam.kernels import dispatch
from megabam.kernels.precision import compute_dtype
from megabam.model.sharding import TensorParallelPlan


@dataclass
class SequenceInfo:
    """What every mixer may need to know about the batch besides the activations."""

    doc_ids: torch.Tensor | None = None  # (B, N) document index per position, for document-aware masking
    # Per-call window of the sliding-window (`swa`) layers, set each step from the window sampler;
    # None = their configured model.swa.window. Full attention layers never take it.
    window: int | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: str = "auto"):
        super().__init__()
        self.eps, self.backend = eps, backend
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.backend)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """x / rms(x) · weight over the last dimension (a function so sequence parallelism can pass a
    weight wrapped for its gradient all-reduce). A 1-D weight on CPU runs the one-pass C form where
    kernels/dispatch.py picks it (`backend`: model.kernels)."""
    if weight.dim() == 1 and (fused := dispatch.fused_cpu_op("rms_norm", backend, x, weight)):
        return fused(x, weight, eps)
    # Normalise in fp32 (fp64 for fp64): bf16 sums of squares lose too much precision at large widths.
    dtype = compute_dtype(x)
    xc = x.to(dtype)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(dtype)).type_as(x)


def head_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of each head's vector: h (B, H, N, D); weight (H·D,) head-major (head h owns
    weight[h·D:(h+1)·D], so it shards by heads; kept 1-D so the optimizer leaves it undecayed like every norm)."""
    return rms_norm(h, weight.view(h.shape[1], 1, h.shape[-1]), eps)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, backend: str = "auto"):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.backend = backend

    def tp_plan(self) -> TensorParallelPlan:
        """The same hidden units of both halves of [gate | up] per rank, and their rows of `down`."""
        return TensorParallelPlan(column={"gate_up": 2}, row=("down",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if fused := dispatch.fused_cpu_op("swiglu", self.backend, gate_up):  # one pass on CPU
            return self.down(fused(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
