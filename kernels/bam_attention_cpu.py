"""BAM attention on CPU where a prior's gradient is needed: the tiled op with each tile's elementwise
passes fused in C (kernels/bam_tiles.c), its matmuls in torch.

The PyTorch reference (kernels/bam_attention.py) makes about ten passes over each logit tile (prior,
mask, softmax, its gradient, the prior gradient's anti-diagonal sums): at 2,048 tokens they cost as
much as its matmuls (docs/benchmarks.md, issue 16). Here the forward makes one (prior, softmax and
the row's logsumexp, which it saves: O(B·H·N)) and the backward two (probabilities from the saved
logsumexp and the softmax gradient; the gradient times the row weight summed along anti-diagonals),
and masked entries are never computed: a row's allowed keys are one contiguous range. Same
arguments, masks, compute dtype and result as bam_attention; its tests compare the two.

The C source is compiled at first use (kernels/cpu_build.py). Without a compiler `library()` is None and
kernels/dispatch.py keeps the reference.
"""

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from megabam.kernels.bam_attention import (
    bam_params,
    check_arguments,
    prior_grads,
    prior_scaled,
    prior_terms,
    query_blocks,
    query_factor,
    tiled_inputs,
)
from megabam.kernels.cpu_build import I64, P, load, ptr
from megabam.kernels.precision import compute_dtype

SOURCE = Path(__file__).with_name("bam_tiles.c")
FORWARD_ARGS = [P, P, P, I64, I64, P, I64, P, I64, I64, P, I64] + [I64] * 6  # bam_tiles.c's order
BACKWARD_ARGS = [P, P, P, I64, I64, P, I64, P, I64, I64, P, I64, P, I64, P, I64] + [I64] * 6


@functools.cache
def library() -> ctypes.CDLL | None:
    """The C tile ops, compiled on first use (kernels/cpu_build.py); None where they cannot be built."""
    return load(
        SOURCE,
        "fused CPU attention tiles",
        {
            f"tile_{p}_{t}": FORWARD_ARGS if p == "forward" else BACKWARD_ARGS
            for p in ("forward", "backward")
            for t in ("f32", "f64")
        },
    )


class CallTables(NamedTuple):
    """What every tile of one call reads, computed once per call rather than per tile."""

    qf: Tensor  # q·f (B, H, N, D): the queries times the scale and SSMax's c (query_factor)
    f: Tensor | float
    log_n: Tensor | None  # ln n_i (B or 1, 1, N, 1), None without SSMax
    prior: tuple | None  # prior_terms at the offsets j - i = N - 1 - m, m = 0 .. 2N - 2
    pscale: Tensor | None  # the prior's row scale c_i (B or 1, H, N) when SSMax scales it, else None
    weight: Tensor | None  # the prior gradient's row weight ln n_i (B or 1, N), likewise


def call_tables(q: Tensor, lo: Tensor, p) -> CallTables:
    """The CallTables of queries q (B, H, N, D) in the compute dtype, key starts lo and BamParams p."""
    N = q.shape[-2]
    log_n = None if p.s is None else torch.log((torch.arange(N) - lo + 1).to(q.dtype))[:, None, :, None]
    f = query_factor(p, log_n)
    prior = None if p.alpha is None else prior_terms(p, (N - 1) - torch.arange(2 * N - 1))
    pscale = weight = None
    if prior is not None and prior_scaled(p):
        pscale = (p.s[None, :, None] * log_n[:, :, :, 0]).contiguous()
        weight = log_n[:, 0, :, 0].contiguous()
    return CallTables((q * f).contiguous(), f, log_n, prior, pscale, weight)


def row_strides(t: Tensor | None, dims: int = 1) -> tuple[int, ...]:
    """The strides of a (B or 1, [H,] N) row table between batch entries (0 when the batch shares it)
    [and heads], in elements; zeros for None."""
    if t is None:
        return (0,) * dims
    return (0 if t.shape[0] == 1 else t.stride(0), *t.stride()[1:-1])


def table_index(N: int, qs: int, ks: int, C: int) -> int:
    """Where the tile of rows qs.. against keys ks..ks + C - 1 (reversed) starts in a per-offset table
    of the call (CallTables.prior, the prior gradient's sums): its entry (0, 0) is at j - i = ks + C - 1 - qs."""
    return (N - 1) - (ks + C - 1 - qs)


def tile_arguments(tb: CallTables, lse: Tensor, N: int, qs: int, ks: int, C: int) -> list:
    """The arguments the C tile ops share after their tensors, for the tile of rows qs.. against keys
    ks..ks + C - 1: the row tables from row qs, the prior from the tile's first offset."""
    table = None if tb.prior is None else tb.prior[0]
    return [
        *(ptr(lse, qs), N * lse.shape[1], N, ptr(table, table_index(N, qs, ks, C)), 2 * N - 1),
        *(ptr(tb.pscale, qs), *row_strides(tb.pscale, 2)),
    ]


class _BAMAttentionCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alpha, beta, mu, s, lo, ssmax_before_prior, block, scale):
        dtype = compute_dtype(q)
        ops = library()
        forward = ops.tile_forward_f64 if dtype == torch.float64 else ops.tile_forward_f32
        p = bam_params(dtype, (alpha, beta, mu, s), ssmax_before_prior, scale)
        B, H, N, D = q.shape
        # Keys and values in reverse order, as in the reference (toeplitz_tile): keys ks..qe-1 are rows
        # N-qe..N-ks, and a tile's prior entry (i, c) is at offset i + c of its table.
        kc = k.to(dtype).flip(2).reshape(B * H, N, D)
        vc = v.to(dtype).flip(2).reshape(B * H, N, -1)
        lo = lo.contiguous()
        tb = call_tables(q.to(dtype), lo, p)
        qf = tb.qf.view(B * H, N, D)
        out = torch.empty(B * H, N, vc.shape[-1], dtype=dtype)
        lse = torch.empty(B, H, N, dtype=dtype)
        rinv = torch.empty(B * H * block, dtype=dtype)  # 1 / each row's softmax sum, per tile (B·H, R)
        for qs, qe, ks in query_blocks(lo, N, block):
            C = qe - ks
            logits = torch.bmm(qf[:, qs:qe], kc[:, N - qe : N - ks].transpose(1, 2))
            R, shared = qe - qs, tile_arguments(tb, lse, N, qs, ks, C)
            forward(logits.data_ptr(), rinv.data_ptr(), *shared, ptr(lo, qs), row_strides(lo)[0], B, H, R, C, qs, ks)
            out[:, qs:qe] = torch.bmm(logits, vc[:, N - qe : N - ks]).mul_(rinv[: B * H * R].view(B * H, R, 1))
        ctx.save_for_backward(q, kc, vc, lo, lse, alpha, beta, mu, s)
        ctx.cfg = (ssmax_before_prior, block, scale, k.dtype, v.dtype)
        return out.view(B, H, N, -1).to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, kc, vc, lo, lse, alpha, beta, mu, s = ctx.saved_tensors
        ssmax_before_prior, block, scale, k_dtype, v_dtype = ctx.cfg
        dtype = compute_dtype(q)
        ops = library()
        backward = ops.tile_backward_f64 if dtype == torch.float64 else ops.tile_backward_f32
        p = bam_params(dtype, (alpha, beta, mu, s), ssmax_before_prior, scale)
        B, H, N, D = q.shape
        qc = q.to(dtype)
        tb = call_tables(qc, lo, p)
        qf = tb.qf.view(B * H, N, D)
        do = dout.to(dtype).reshape(B * H, N, -1)
        dqf, dk, dv = torch.empty_like(qf), torch.zeros_like(kc), torch.zeros_like(vc)
        sums = None if tb.prior is None else torch.zeros(B, H, 2 * N - 1, dtype=dtype)
        for qs, qe, ks in query_blocks(lo, N, block):
            R, C = qe - qs, qe - ks
            kb, vb, dob = kc[:, N - qe : N - ks], vc[:, N - qe : N - ks], do[:, qs:qe]
            prob = torch.bmm(qf[:, qs:qe], kb.transpose(1, 2))
            dlogits = torch.bmm(dob, vb.transpose(1, 2))
            shared = tile_arguments(tb, lse, N, qs, ks, C)
            backward(
                *(prob.data_ptr(), dlogits.data_ptr(), *shared, ptr(tb.weight, qs), row_strides(tb.weight)[0]),
                *(ptr(sums, table_index(N, qs, ks, C)), 2 * N - 1, ptr(lo, qs), row_strides(lo)[0], B, H, R, C, qs, ks),
            )
            # A product into a new tensor, then added: baddbmm_ into these strided slices ran as one
            # matrix product per head, at ~3x the time.
            dv[:, N - qe : N - ks] += torch.bmm(prob.transpose(1, 2), dob)
            dk[:, N - qe : N - ks] += torch.bmm(dlogits.transpose(1, 2), qf[:, qs:qe])
            dqf[:, qs:qe] = torch.bmm(dlogits, kb)  # d/d(q·f)
        dqf = dqf.view(B, H, N, D)
        dq = dqf * tb.f
        da, db, dm, ds = (torch.zeros(H, dtype=dtype) for _ in range(4))
        if s is not None:  # the q·k part of dL/ds, as in the reference
            ds += (tb.log_n * (dqf * qc).sum(-1, keepdim=True)).sum((0, 2, 3)) * scale
        if tb.prior is not None:
            for total, g in zip((da, db, dm, ds), prior_grads(sums.sum(0), tb.prior, p)):
                if g is not None:
                    total += g
        if mu is not None:
            dm = dm * 2 * torch.cosh(p.mu)
        dk, dv = dk.view(B, H, N, D).flip(2), dv.view(B, H, N, -1).flip(2)
        dtypes = (q.dtype, k_dtype, v_dtype, *(None if t is None else t.dtype for t in (alpha, beta, mu, s)))
        grads = (dq, dk, dv, da, db, dm, ds)
        needed = (g.to(t) if ctx.needs_input_grad[i] else None for i, (g, t) in enumerate(zip(grads, dtypes)))
        return (*needed, None, None, None, None)


def bam_attention_cpu(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    theta_alpha: Tensor | None = None,
    theta_beta: Tensor | None = None,
    theta_mu: Tensor | None = None,
    ssmax_s: Tensor | None = None,
    ssmax_before_prior: bool = False,
    doc_ids: Tensor | None = None,
    window: int | None = None,
    block_size: int = 128,
    scale: float | None = None,
) -> Tensor:
    """megabam.kernels.bam_attention.bam_attention (same arguments and result) on CPU tensors, with
    the fused C tiles; needs library() to be built."""
    check_arguments(q, k, v, theta_alpha, theta_beta, theta_mu, window)
    if q.is_cuda or library() is None:
        raise ValueError("bam_attention_cpu needs CPU tensors and the built C tiles (library())")
    k, v, lo, scale = tiled_inputs(q, k, v, doc_ids, window, scale)
    return _BAMAttentionCPU.apply(
        q, k, v, theta_alpha, theta_beta, theta_mu, ssmax_s, lo, ssmax_before_prior, block_size, scale
    )
