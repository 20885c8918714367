"""RMS normalisation, the SwiGLU product and the rotary embedding on CPU in one pass each way
(kernels/cpu_fused.c).

The PyTorch forms (megabam/model/layers.py, positional.py) make a pass per operation (square, mean,
rsqrt, two products; silu, product; complex views and product) and more in the backward, plus, for
SwiGLU, a concatenation of the gradients of the two halves of the fused projection: measured at 2,048
tokens per step on the tiny models, 1.1 ms per norm, 1.9 ms per MLP and 0.8 ms per rotation, about 14 %
of a step (docs/log/benchmarks-history.md, "CPU training speed"). These compute the same values for
CPU tensors of fp32 or fp64 (norms with a 1-D weight); kernels/dispatch.py decides where they run, and
the PyTorch forms stay for everything else (CUDA, bf16, per-head norms).
"""

import functools
from pathlib import Path

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from megabam.kernels.cpu_build import F64, I64, P, load, ptr

SOURCE = Path(__file__).with_name("cpu_fused.c")
NORM_BLOCK = 64  # cpu_fused.c's rows per partial sum of the weight gradient
SIGNATURES = {
    "rms_norm_forward": [P, P, P, P, I64, I64, F64],
    "rms_norm_backward": [P, P, P, P, P, P, P, I64, I64],
    "swiglu_forward": [P, P, I64, I64],
    "swiglu_backward": [P, P, P, I64, I64],
    "rope": [P, I64, P, P, I64, I64, I64, I64, I64],
}
SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


@functools.cache
def library():
    """The fused ops, compiled on first use (kernels/cpu_build.py); None where they cannot be built."""
    return load(
        SOURCE,
        "fused CPU norm, MLP and rotary ops",
        {f"{n}_{s}": t for n, t in SIGNATURES.items() for s in ("f32", "f64")},
    )


def applies(*tensors: Tensor) -> bool:
    """Whether these ops take the tensors: on the CPU, all of one dtype, fp32 or fp64."""
    x = tensors[0]
    return (
        x.device.type == "cpu"
        and x.dtype in SUFFIX
        and all(t.device == x.device and t.dtype == x.dtype for t in tensors)
    )


def _op(name: str, dtype: torch.dtype):
    return getattr(library(), f"{name}_{SUFFIX[dtype]}")


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x, weight = x.contiguous(), weight.contiguous()
        D = x.shape[-1]
        y, rstd = torch.empty_like(x), x.new_empty(x.numel() // D)
        _op("rms_norm_forward", x.dtype)(ptr(x), ptr(weight), ptr(y), ptr(rstd), rstd.numel(), D, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        rows, D = rstd.numel(), x.shape[-1]
        dx, dw = torch.empty_like(x), torch.empty_like(weight)
        partial = x.new_empty(-(-rows // NORM_BLOCK), D)
        _op("rms_norm_backward", x.dtype)(
            ptr(x), ptr(weight), ptr(rstd), ptr(dy), ptr(dx), ptr(dw), ptr(partial), rows, D
        )
        return dx, dw, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        gate_up = gate_up.contiguous()
        H = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], H)
        _op("swiglu_forward", gate_up.dtype)(ptr(gate_up), ptr(out), out.numel() // max(H, 1), H)
        ctx.save_for_backward(gate_up)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        dy = dy.contiguous()
        H = gate_up.shape[-1] // 2
        dgate_up = torch.empty_like(gate_up)
        _op("swiglu_backward", gate_up.dtype)(ptr(gate_up), ptr(dy), ptr(dgate_up), dy.numel() // max(H, 1), H)
        return dgate_up


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rotation):
        B, N, heads, D = x.shape
        # Rows (b, n) of heads × D values each, evenly spaced (the q, k part of the fused projection is)
        if not (x.stride(-1) == 1 and x.stride(-2) == D and (B == 1 or x.stride(0) == N * x.stride(1))):
            x = x.contiguous()
        rot = torch.view_as_real(rotation.to(COMPLEX[x.dtype])).contiguous()  # (N, D/2, (cos, sin))
        out = x.new_empty(B, N, heads, D)
        _op("rope", x.dtype)(ptr(x), x.stride(1), ptr(rot), ptr(out), B * N, N, heads * D, D, 0)
        ctx.save_for_backward(rot)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (rot,) = ctx.saved_tensors
        dy = dy.contiguous()
        B, N, heads, D = dy.shape
        dx = torch.empty_like(dy)
        _op("rope", dy.dtype)(ptr(dy), heads * D, ptr(rot), ptr(dx), B * N, N, heads * D, D, 1)  # rotated back
        return dx, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / rms(x) · weight over the last dimension (weight 1-D): layers.rms_norm's value."""
    return _RMSNorm.apply(x, weight, eps)


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate) · up for gate_up = [gate | up] along the last dimension: the SwiGLU MLP's product."""
    return _SwiGLU.apply(gate_up)


def rope(x: Tensor, rotation: Tensor) -> Tensor:
    """x (B, N, heads, D) with each pair (x[2k], x[2k+1]) rotated by rotation (N, D/2) complex:
    positional.apply_rope's value."""
    return _Rope.apply(x, rotation)
