"""BAM attention on CPU: the fused C kernel (kernels/bam_attention_cpu.c) for every prior, mask and
SSMax variant, its gradients included (the prior's too).

Each query block of 64 rows meets its keys 64 at a time: the tile's products, prior, masks and online
softmax stay in the core's caches, and masked tiles are never computed. The forward saves the output,
each row's logit maximum and log of its sum (kept apart: one logsumexp of a large magnitude rounds
away the digits p needs) and the key of that maximum (O(B·H·N·D)); the backward recomputes each tile
(FlashAttention-2's scheme) and returns dq, dk, dv and the prior gradient's sums along
anti-diagonals, centred on each row's largest logit (bam_attention_cpu_impl.h says why), from which
prior_grads makes dθ. The earlier form of this op left the products to torch and fused only each
tile's elementwise passes; written tiles of block × N values went through memory, and the op ran at
1.3-1.5x torch's causal attention's time; this one at 0.72-0.91x of it (AVX-512, with a prior or
without), so that kernels/dispatch.py runs it for every CPU call there (docs/benchmarks.md, "CPU
kernels"). Same arguments, masks, SSMax key cap (ln n_i then per head in its row tables), compute
dtype and result as bam_attention (v's head width must be q's); its tests compare the two.

The C source is compiled at first use (kernels/cpu_build.py). Without a compiler `library()` is None and
kernels/dispatch.py keeps torch's fused attention or the reference.
"""

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from megabam.kernels.bam_attention import (
    AttentionOptions,
    bam_params,
    capped_log,
    key_count_log,
    prior_grads,
    prior_scaled,
    prior_terms,
    query_factor,
    tiled_inputs,
)
from megabam.kernels.cpu_build import I64, P, load, ptr
from megabam.kernels.precision import compute_dtype

SOURCE = Path(__file__).with_name("bam_attention_cpu.c")
FORWARD_ARGS = [P] * 7 + [I64, P, I64, I64, P, I64, P] + [I64] * 5  # bam_attention_cpu.c's order
BACKWARD_ARGS = [P] * 12 + [I64, P, I64, I64, P, I64, I64, P, I64, P, I64, P] + [I64] * 5


@functools.cache
def library() -> ctypes.CDLL | None:
    """The fused attention tiles, compiled on first use (kernels/cpu_build.py); None where they cannot
    be built."""
    return load(
        SOURCE,
        "fused CPU attention tiles",
        {
            f"flash_{p}_{t}": FORWARD_ARGS if p == "forward" else BACKWARD_ARGS
            for p in ("forward", "backward")
            for t in ("f32", "f64")
        },
    )


def tile_rows() -> int:
    """Query rows per block of the C kernel (bam_attention_cpu.c's ROWS)."""
    return ctypes.c_int64.in_dll(library(), "tile_rows").value


def wide_vectors() -> bool:
    """Whether the kernel was compiled for 512-bit vectors (AVX-512), where it is measured faster than
    torch's fused attention without a prior too (docs/benchmarks.md); narrower builds are not."""
    return ctypes.c_int64.in_dll(library(), "vector_bytes").value >= 64


class CallTables(NamedTuple):
    """What the forward and the backward both compute from the inputs, once per call."""

    qf: Tensor  # q·f (B, H, N, D): the queries times the scale and SSMax's c (query_factor)
    f: Tensor | float
    log_n: Tensor | None  # ln n_i (B or 1, 1 or H (a key cap), N, 1), None without SSMax
    prior: tuple | None  # prior_terms at the offsets j - i = N - 1 - m, m = 0 .. 2N - 2
    table: Tensor | None  # prior[0] padded with a block of zeros (the last block's padding rows read it)
    pscale: Tensor | None  # the prior's row scale c_i (B or 1, H, N) when SSMax scales it, else None
    weight: Tensor | None  # the prior gradient's row weight ln n_i (B or 1, H, N; a view), likewise
    kstart: Tensor  # (B or 1, blocks): the first key any row of each query block sees


def call_tables(q: Tensor, lo: Tensor, p) -> CallTables:
    """The CallTables of queries q (B, H, N, D) in the compute dtype, key starts lo and BamParams p."""
    N = q.shape[-2]
    log_n = (
        None if p.s is None else capped_log(key_count_log(lo, torch.arange(N), q.dtype)[:, None, :, None], p.key_cap)
    )
    f = query_factor(p, log_n)
    prior = table = None if p.alpha is None else prior_terms(p, (N - 1) - torch.arange(2 * N - 1))
    if prior is not None:
        table = torch.cat([prior[0], prior[0].new_zeros(prior[0].shape[0], tile_rows())], 1)
    pscale = weight = None
    if prior is not None and prior_scaled(p):
        pscale = (p.s[None, :, None] * log_n[:, :, :, 0]).contiguous()
        weight = log_n[:, :, :, 0].expand(-1, q.shape[1], -1)  # the heads share it (stride 0) unless capped
    return CallTables((q * f).contiguous(), f, log_n, prior, table, pscale, weight, block_key_starts(lo, N))


def block_key_starts(lo: Tensor, N: int) -> Tensor:
    """The first key any row of each query block of the kernel sees, (B or 1, blocks): lo is
    non-decreasing along a row, so its value at the block's first row. A window thus bounds every
    block's keys to its rows plus the window."""
    return lo[:, :: tile_rows()].contiguous()


def row_strides(t: Tensor | None, dims: int = 1) -> tuple[int, ...]:
    """The strides of a (B or 1, [H,] N) row table between batch entries (0 when the batch shares it)
    [and heads], in elements; zeros for None."""
    if t is None:
        return (0,) * dims
    return (0 if t.shape[0] == 1 else t.stride(0), *t.stride()[1:-1])


def prior_arguments(tb: CallTables) -> list:
    """The C kernels' arguments for the prior: its table and head stride, its row scale and strides."""
    stride = 0 if tb.table is None else tb.table.stride(0)
    return [ptr(tb.table), stride, ptr(tb.pscale), *row_strides(tb.pscale, 2)]


def mask_arguments(tb: CallTables, lo: Tensor) -> list:
    """The C kernels' arguments for the masks: each row's first key, each query block's."""
    return [ptr(lo), row_strides(lo)[0], ptr(tb.kstart), row_strides(tb.kstart)[0]]


class _BAMAttentionCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alpha, beta, mu, s, lo, ssmax_before_prior, scale, key_cap):
        dtype = compute_dtype(q)
        forward = library().flash_forward_f64 if dtype == torch.float64 else library().flash_forward_f32
        p = bam_params(dtype, (alpha, beta, mu, s), ssmax_before_prior, scale, key_cap)
        B, H, N, D = q.shape
        kc, vc, lo = k.to(dtype).contiguous(), v.to(dtype).contiguous(), lo.contiguous()
        tb = call_tables(q.to(dtype), lo, p)
        out = torch.empty(B, H, N, D, dtype=dtype)
        stats = torch.empty(B, H, N, 2, dtype=dtype)  # each row's logit max and the log of its sum
        top = torch.empty(B, H, N, dtype=torch.int64)  # the key of that max
        tensors = (tb.qf, kc, vc, out, stats, top)
        forward(*(t.data_ptr() for t in tensors), *prior_arguments(tb), *mask_arguments(tb, lo), B, H, N, D)
        ctx.save_for_backward(q, kc, vc, out, lo, stats, top, alpha, beta, mu, s, key_cap)
        ctx.cfg = (ssmax_before_prior, scale, k.dtype, v.dtype)
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, kc, vc, out, lo, stats, top, alpha, beta, mu, s, key_cap = ctx.saved_tensors
        ssmax_before_prior, scale, k_dtype, v_dtype = ctx.cfg
        dtype = compute_dtype(q)
        backward = library().flash_backward_f64 if dtype == torch.float64 else library().flash_backward_f32
        p = bam_params(dtype, (alpha, beta, mu, s), ssmax_before_prior, scale, key_cap)
        B, H, N, D = q.shape
        qc = q.to(dtype)
        tb = call_tables(qc, lo, p)
        do = dout.to(dtype).contiguous()
        delta = (do * out).sum(-1)  # FlashAttention-2's D: Σ_j p_ij·dP_ij per row
        dqf, dk, dv = torch.empty_like(tb.qf), torch.zeros_like(kc), torch.zeros_like(vc)
        rowsum = torch.empty(B, H, N, dtype=dtype)
        sums = None if tb.table is None else torch.zeros(B, H, tb.table.shape[1], dtype=dtype)
        tensors = (tb.qf, kc, vc, do, stats, top, delta, dqf, rowsum, dk, dv)
        backward(
            *(t.data_ptr() for t in tensors),
            *prior_arguments(tb),
            *(ptr(tb.weight), *row_strides(tb.weight, 2), ptr(sums), 0 if sums is None else sums.shape[2]),
            *mask_arguments(tb, lo),
            *(B, H, N, D),
        )
        # Σ_j dS_ij·k_j as Σ_j dS_ij·(k_j - k_j*), j* the key of row i's largest logit, as the kernel
        # centres the prior's sums (bam_attention_cpu_impl.h, backward): it feeds ds and dq.
        dqf.sub_(rowsum[..., None] * kc.gather(2, top[..., None].expand(-1, -1, -1, D)))
        dq = dqf * tb.f
        da, db, dm, ds = (torch.zeros(H, dtype=dtype) for _ in range(4))
        if s is not None:  # the q·k part of dL/ds, as in the reference
            ds += (tb.log_n * (dqf * qc).sum(-1, keepdim=True)).sum((0, 2, 3)) * scale
        if tb.prior is not None:
            for total, g in zip((da, db, dm, ds), prior_grads(sums.sum(0)[:, : 2 * N - 1], tb.prior, p)):
                if g is not None:
                    total += g
        if mu is not None:
            dm = dm * 2 * torch.cosh(p.mu)
        dtypes = (q.dtype, k_dtype, v_dtype, *(None if t is None else t.dtype for t in (alpha, beta, mu, s)))
        grads = (dq, dk, dv, da, db, dm, ds)
        needed = (g.to(t) if ctx.needs_input_grad[i] else None for i, (g, t) in enumerate(zip(grads, dtypes)))
        return (*needed, None, None, None, None)


def bam_attention_cpu(q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions = AttentionOptions()) -> Tensor:
    """megabam.kernels.bam_attention.bam_attention (same arguments and result) on CPU tensors, with
    the fused C kernel; needs library() to be built. `options.block_size` is not read: the kernel's
    tiles are its own (64 rows by 64 keys) and its memory does not depend on them."""
    options.check(q, k, v)
    if q.is_cuda or library() is None:
        raise ValueError("bam_attention_cpu needs CPU tensors and the built C kernel (library())")
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"bam_attention_cpu needs v's head width to be q's, got {v.shape[-1]} and {q.shape[-1]}")
    k, v, lo, scale = tiled_inputs(q, k, v, options)
    return _BAMAttentionCPU.apply(
        q, k, v, *options.head_tensors, lo, options.ssmax_before_prior, scale, options.ssmax_key_cap
    )
