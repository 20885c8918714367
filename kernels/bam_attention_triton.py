"""BAM attention (GGD prior + SSMax, causal, documents, sliding window) as fused Triton kernels.

Same semantics as the pure-PyTorch reference (kernels/bam_attention.py), flash-attention style: the
forward walks the key tiles of each query block with an online softmax and saves the row
log-sum-exp, so no N×N tensor exists. Key tiles outside a row block's causal / document / window
range are skipped by the loop bounds, so with a window the cost is N·w. The backward recomputes each
tile twice: once per key block (dk, dv) and once per query block (dq and the per-head gradients of
θα, θβ, θμ, s, written as one partial sum per row and reduced afterwards: deterministic, no atomics).

One special-function operation per score. The prior depends on the offset i - j only (and the
head's θ), so the host computes it once per call as a per-head table over a causal row's offsets
0..N-1 (prior_tables: O(N·H), from the reference's prior_terms) and a tile reads it with one gather
by offset. SSMax's c = s·ln n_i is a per-row vector (ln n_i a host table like lo; per head with
AttentionOptions.ssmax_key_cap, n_i at most the head's cap: nothing per score), and the softmax
scale and log2(e) fold into q·k's row factor f, so the logits come out in log2 units, q·k·f + prior·c
(or + prior), and p = exp2(logits - m): the only transcendental per score. Each row's max m and
log2 of its sum are stored apart (STATS; one log-sum-exp of magnitude 10³-10⁴, which q, k × 30 or a
steep prior give, would round p by up to 10⁻³), with the key of the max (TOP). The dq kernel's θ
gradients are per-row sums of dL/dlogits times per-offset weight tables (the prior's derivatives,
prior_weights at dL/dprior = 1: one gather and one FMA per table per score); the q·k part of dL/ds
is a row dot product of q with dL/dlogits·k, taken once per row.
Those row sums are centred on the row's largest logit, Σ_j dS_ij·(X_ij - X_ij*) (the reasons are the
C kernel's: kernels/bam_attention_cpu_impl.h, backward), so a row whose softmax is one key adds 0.
tools/kernel_budget.py counts the result in the compiled machine code (docs/benchmarks.md).

Tiles the prior empties are left out (SKIP_EMPTY_TILES): a local head (θβ >= 1) puts most of a long
row's keys so far below its max that exp2 gives exactly 0, and computing them would add exactly
nothing. live_ranges bounds every score of a group of rows against a group of keys on the host
(‖q_i‖·|f_i|·‖k_j‖ plus the prior's largest value over their offsets; the prior is unimodal in the
offset, or largest at an end) and gives each row group the span of keys, and each key group the span
of rows, outside which that bound is more than exp2's underflow below the rows' max (the forward's
lower bound: each row's diagonal logit; the backward's: its final max); the kernels' loops run over
those spans only, the forward from the diagonal back so that every row's running max is past its
diagonal logit before a left-out tile would come. Outputs and gradients are bit-identical to the
full loops (tests/unit/test_kernels_triton.py), and a local head costs about a sliding window.

The dk/dv kernel works on transposed tiles (keys × queries) so that p and dL/dlogits feed dv and dk
as the dots' left operands with no transpose in registers. The autotune lists keep only
configurations that compile without register spills for sm_90 (tests/unit/test_kernel_budget.py).

Grouped-query attention: k, v may have H_kv heads, H_kv dividing q's H; query head h reads kv head
h // GROUP, GROUP = H // H_kv (a runtime argument). The forward and the dq kernel index the shared
head; the dk/dv kernel runs one program per (key block, batch·kv head) that loops over the GROUP
query heads of its kv head, accumulating dk, dv in registers in a fixed order: deterministic, no
atomics, no per-query-head buffers, and each k, v tile is loaded once per group rather than once per
query head. GROUP = 1 is the per-head computation unchanged.

Plain pointer arithmetic only (no block pointers): one source runs under the GPU image's Triton 3.6
and the CPU interpreter of the pinned Triton 3.9 (TRITON_INTERPRET=1, read when this module is
imported). The interpreter's bf16 arithmetic is wrong, so when interpreting every load is upcast to
fp32 at once; on a GPU the dot products take the input dtype (tensor cores) and accumulate in fp32.
"""

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from megabam.kernels.bam_attention import (
    AttentionOptions,
    bam_params,
    capped_log,
    key_count_log,
    key_start,
    prior_terms,
    prior_weights,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter runs ~1-3 ms per tile iteration whatever the tile size, and autotune with more than
# one config fails there: one small config when interpreting, a few tuned ones on the GPU.
INTERPRET_BLOCK = 16
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The logits are kept in log2 units (exp2 is the special-function unit's own exponential): the
# prior's table holds prior·log2(e), q·k's row factor has it too, and the lse goes out in natural log.
LOG2E = math.log2(math.e)
# Constexpr globals: the only globals a compiled kernel may read.
LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(math.log(2))
# exp2 of anything below -UNDERFLOW is exactly 0 in fp32 (its smallest subnormal is 2^-149).
UNDERFLOW = 160.0
# Key tiles whose every score the prior provably puts exp2's underflow below its row's max add
# exactly 0; the loops leave out those at either end of their range (live_ranges: bit-identical
# results). The tests turn it off to compare.
SKIP_EMPTY_TILES = True


def _configs(pairs):
    if INTERPRET:
        return [triton.Config({"BLOCK_M": INTERPRET_BLOCK, "BLOCK_N": INTERPRET_BLOCK})]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in pairs]


_TUNE_KEY = ["N", "BLOCK_D", "HAS_PRIOR", "HAS_SSMAX"]


@triton.jit
def _load_rows(ptr, offs, offs_d, stride_n, stride_d, n, d, UPCAST: tl.constexpr):
    """A (len(offs), BLOCK_D) tile of rows offs of a (N, D) matrix; zeros outside; fp32 if UPCAST."""
    x = tl.load(
        ptr + offs[:, None] * stride_n + offs_d[None, :] * stride_d,
        mask=(offs[:, None] < n) & (offs_d[None, :] < d),
        other=0.0,
    )
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _row_scales(LOGN, S, offs_m, n, scale, HAS_SSMAX: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per row of offs_m: (f, c, ln n_i), LOGN and S at this (batch, head)'s row and s. f multiplies
    q·k in the logits in log2 units, scale·log2(e)·c; c = s·ln n_i is SSMax's factor (1 without
    SSMax, where ln n_i is 0)."""
    log_n = tl.zeros([BLOCK_M], tl.float32)
    c = log_n + 1.0
    if HAS_SSMAX:
        log_n = tl.load(LOGN + offs_m, mask=offs_m < n, other=0.0)
        c = tl.load(S) * log_n
    return c * (scale * LOG2E_C), c, log_n


@triton.jit
def tile(
    q,
    k,
    offs_m,
    offs_n,
    lo_m,
    n,
    f,
    c,
    PRIOR,
    HAS_PRIOR: tl.constexpr,
    HAS_SSMAX: tl.constexpr,
    BEFORE: tl.constexpr,
    PRECISION: tl.constexpr,
    KEY_ROWS: tl.constexpr = False,
):
    """Masked logits of query rows offs_m against keys offs_n, as the reference's block_logits times
    log2(e): q·k·f + prior·c (SSMax scaling the prior) or + prior, -inf where not allowed. f, c,
    lo_m are per query (_row_scales). KEY_ROWS: the transposed tile (keys × queries), the dk/dv
    kernel's orientation, where p and dlogits feed dk, dv without a transpose in registers.

    Returns (logits, prior, allowed): prior (log2 units, 0 where not allowed) is the head's prior
    table PRIOR read at the offsets i - j, a placeholder without a prior."""
    if KEY_ROWS:
        qk = tl.dot(k, tl.trans(q), input_precision=PRECISION)
        i, j, lo, f, c = offs_m[None, :], offs_n[:, None], lo_m[None, :], f[None, :], c[None, :]
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        i, j, lo, f, c = offs_m[:, None], offs_n[None, :], lo_m[:, None], f[:, None], c[:, None]
    allowed = (j <= i) & (j >= lo) & (i < n)
    logits = qk * f
    prior = qk
    if HAS_PRIOR:
        # An allowed entry has 0 <= i - j < n, a valid table index; the others are not read.
        prior = tl.load(PRIOR + (i - j), mask=allowed, other=0.0)
        if HAS_SSMAX and not BEFORE:
            logits += prior * c
        else:
            logits += prior
    return tl.where(allowed, logits, float("-inf")), prior, allowed


@triton.jit
def _live_span(RANGES, start, stop, G):
    """The span (first, end) of the other side's rows or keys that the groups of G covering
    start..stop-1 may need (live_ranges' table of (first, end) per group)."""
    first = tl.load(RANGES + (start // G) * 2)
    end = tl.load(RANGES + (start // G) * 2 + 1)
    for g in range(start // G + 1, (stop - 1) // G + 1):
        first = tl.minimum(first, tl.load(RANGES + g * 2))
        end = tl.maximum(end, tl.load(RANGES + g * 2 + 1))
    return first, end


# Every config in the three lists compiles without register spills for sm_90 at D 128 (bf16/fp16
# inputs, GROUP 1 and > 1; tools/kernel_budget.py, tests/unit/test_kernel_budget.py); chosen so, not
# yet timed on a GPU. Dropped for spilling: forward 128x64 and 64x128 at 4 warps; dk/dv 64-query tiles
# (64x128 w8, 64x64 w4), any tile at 4 warps with 128 keys, and the 32-query tiles (at GROUP > 1 since
# the group loop wraps the query loop, at 1 too since the live spans bound it); dq 64-key tiles
# (128x64 w8, 64x64 w4), 64x32 at 4 warps, and 128x32 (once the row sums were centred and the key
# span bounded: a row's key j* and its sum of dL/dlogits live to the end).
@triton.autotune(configs=_configs([(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 128, 8, 4)]), key=_TUNE_KEY)
@triton.jit
def fwd_kernel(
    Q,
    K,
    V,
    O,
    STATS,
    TOP,
    LO,
    LOGN,
    TABLE,
    S,
    LIVE,
    sqb,
    sqh,
    sqn,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    slob,
    slnb,
    slnh,
    H,
    GROUP,
    N,
    D,
    G,
    scale,
    HAS_PRIOR: tl.constexpr,
    HAS_SSMAX: tl.constexpr,
    BEFORE: tl.constexpr,
    SKIP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Output rows, each row's (max, log2 of the sum) of its logits in log2 units and the key of the max,
    for one query block of one (batch, query head)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # base offsets b·stride, bh·N·D can pass 2^31
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP  # the key/value head of query head h
    q_start = pid_m * BLOCK_M
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    lo_m = tl.load(LO + b * slob + offs_m, mask=offs_m < N, other=0)
    q = _load_rows(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, sqd, N, D, UPCAST)
    f, c, _ = _row_scales(LOGN + b * slnb + h * slnh, S + h, offs_m, N, scale, HAS_SSMAX, BLOCK_M)

    # Online softmax in log2 units: one exp2 per score.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    top = offs_m  # the key of each row's largest logit so far (the diagonal: always allowed)
    # lo is non-decreasing in the row, so the block's first row has the earliest key.
    k_lo = (tl.load(LO + b * slob + q_start) // BLOCK_N) * BLOCK_N
    k_end = tl.minimum(q_start + BLOCK_M, N)
    if SKIP:  # the key tiles at either end that the prior empties (live_ranges)
        first, end = _live_span(LIVE + pid_bh * tl.cdiv(N, G) * 2, q_start, tl.minimum(q_start + BLOCK_M, N), G)
        k_lo = tl.maximum(k_lo, (first // BLOCK_N) * BLOCK_N)
        k_end = tl.minimum(k_end, end)
    # From the diagonal back: by the time the tiles left out would come, each row's running max is
    # past its diagonal logit, which live_ranges bounded them by (they would add exactly 0).
    k_last = ((k_end - 1) // BLOCK_N) * BLOCK_N
    for t in range(0, (k_last - k_lo) // BLOCK_N + 1):
        k_start = k_last - t * BLOCK_N
        offs_n = k_start + tl.arange(0, BLOCK_N)
        k = _load_rows(K + b * skb + hk * skh, offs_n, offs_d, skn, skd, N, D, UPCAST)
        v = _load_rows(V + b * svb + hk * svh, offs_n, offs_d, svn, svd, N, D, UPCAST)
        logits = tile(q, k, offs_m, offs_n, lo_m, N, f, c, TABLE + h * N, HAS_PRIOR, HAS_SSMAX, BEFORE, PRECISION)[0]
        tile_max, tile_top = tl.max(logits, 1, return_indices=True)
        top = tl.where(tile_max > m_i, k_start + tile_top, top)
        m_new = tl.maximum(m_i, tile_max)
        # A row may have no allowed key in this tile yet (document or window start further on):
        # subtract 0 then, so exp2() gives 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(logits - m_safe[:, None])
        corr = tl.exp2(m_i - m_safe)
        l_i = l_i * corr + tl.sum(p, 1)
        acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    row_ok = offs_m < N
    l_i = tl.where(row_ok, l_i, 1.0)  # padding rows saw nothing; keep them finite
    o_ptr = O + pid_bh * N * BLOCK_D + offs_m[:, None] * BLOCK_D + offs_d[None, :]
    tl.store(o_ptr, acc / l_i[:, None], mask=row_ok[:, None])
    tl.store(STATS + (pid_bh * N + offs_m) * 2, m_i, mask=row_ok)
    tl.store(STATS + (pid_bh * N + offs_m) * 2 + 1, tl.log2(l_i), mask=row_ok)
    tl.store(TOP + pid_bh * N + offs_m, top, mask=row_ok)


# The GPU image's Triton 3.6 spills dk/dv's 4-warp tile with grouped query heads and the pinned 3.9
# does not; 3.7 and 3.8 were not compiled here, so they are treated as 3.6.
SPILLS_GROUPED_W4 = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9)


def _no_spilling_group_tiles(configs, named_args, **kwargs):
    """Compiled for sm_90 by Triton 3.6, dk/dv's 16x64 tile at 4 warps spills 6 words with GROUP > 1
    (outside the score loop: tools/kernel_budget.py, docs/benchmarks.md "Instruction budget"); 3.9
    keeps them in registers. There, grouped heads take the 8-warp tile alone."""
    if not SPILLS_GROUPED_W4 or {**named_args, **kwargs}["GROUP"] == 1:
        return configs
    return [c for c in configs if not (c.kwargs["BLOCK_N"] == 64 and c.num_warps == 4)]


# GROUP in the key: with grouped-query attention the dk/dv grid has GROUP times fewer, longer programs.
@triton.autotune(
    configs=_configs([(16, 128, 8, 2), (16, 64, 4, 2)]),
    key=_TUNE_KEY + ["GROUP"],
    prune_configs_by={"early_config_prune": _no_spilling_group_tiles},
)
@triton.jit
def bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    STATS,
    DELTA,
    LO,
    LAST,
    DK,
    DV,
    LOGN,
    TABLE,
    S,
    LIVE,
    sqb,
    sqh,
    sqn,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdb,
    sdh,
    sdn,
    sdd,
    slob,
    slnb,
    slnh,
    H,
    GROUP,
    N,
    D,
    G,
    scale,
    HAS_PRIOR: tl.constexpr,
    HAS_SSMAX: tl.constexpr,
    BEFORE: tl.constexpr,
    SKIP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dk, dv of one key block of one (batch, key/value head), looping over the GROUP query heads
    that share the head and, for each, over the query blocks that can see the block."""
    pid_n = tl.program_id(0)
    pid_bhk = tl.program_id(1).to(tl.int64)  # base offsets b·stride, bh·N·D can pass 2^31
    h_kv = H // GROUP
    b = pid_bhk // h_kv
    hk = pid_bhk % h_kv
    k_start = pid_n * BLOCK_N
    offs_n = k_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K + b * skb + hk * skh, offs_n, offs_d, skn, skd, N, D, UPCAST)
    v = _load_rows(V + b * svb + hk * svh, offs_n, offs_d, svn, svd, N, D, UPCAST)

    # Accumulated over the group's query heads in registers, in a fixed order: deterministic, no
    # atomics and no per-query-head buffer. GROUP = 1 is one pass, the per-head kernel as it was.
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Rows from the diagonal up to LAST[b, last key of the block] (exclusive) may see these keys.
    q_lo = (k_start // BLOCK_M) * BLOCK_M
    q_hi = tl.load(LAST + b * slob + tl.minimum(k_start + BLOCK_N, N) - 1)
    for g in range(0, GROUP):
        h = hk * GROUP + g  # query head
        pid_bh = b * H + h  # its rows of STATS and DELTA
        q_first = q_lo
        q_end = q_hi
        if SKIP:  # the query blocks at either end whose every score with these keys is 0 (live_ranges)
            first, end = _live_span(LIVE + pid_bh * tl.cdiv(N, G) * 2, k_start, tl.minimum(k_start + BLOCK_N, N), G)
            q_first = tl.maximum(q_lo, (first // BLOCK_M) * BLOCK_M)
            q_end = tl.minimum(q_hi, end)
        for q_start in range(q_first, q_end, BLOCK_M):
            offs_m = q_start + tl.arange(0, BLOCK_M)
            row_ok = offs_m < N
            lo_m = tl.load(LO + b * slob + offs_m, mask=row_ok, other=0)
            q = _load_rows(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, sqd, N, D, UPCAST)
            do = _load_rows(DO + b * sdb + h * sdh, offs_m, offs_d, sdn, sdd, N, D, UPCAST)
            m2 = tl.load(STATS + (pid_bh * N + offs_m) * 2, mask=row_ok, other=0.0)
            l2 = tl.load(STATS + (pid_bh * N + offs_m) * 2 + 1, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + pid_bh * N + offs_m, mask=row_ok, other=0.0)
            f, c, _ = _row_scales(LOGN + b * slnb + h * slnh, S + h, offs_m, N, scale, HAS_SSMAX, BLOCK_M)
            # Transposed tiles (keys × queries): p^T and dlogits^T are dv's and dk's left operands.
            logits_t = tile(
                q, k, offs_m, offs_n, lo_m, N, f, c, TABLE + h * N, HAS_PRIOR, HAS_SSMAX, BEFORE, PRECISION, True
            )[0]
            p_t = tl.exp2(logits_t - m2[None, :] - l2[None, :])
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            dqk_t = p_t * (dp_t - delta[None, :])
            if HAS_SSMAX:
                dqk_t = dqk_t * c[None, :]
            dk += tl.dot(dqk_t.to(q.dtype), q, input_precision=PRECISION)

    col_ok = (offs_n[:, None] < N) & (offs_d[None, :] < D)
    out = pid_bhk * N * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=col_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.autotune(configs=_configs([(64, 32, 8, 2), (128, 16, 8, 2)]), key=_TUNE_KEY)
@triton.jit
def bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    STATS,
    TOP,
    DELTA,
    LO,
    DQ,
    PARTIAL,
    LOGN,
    TABLE,
    S,
    LIVE,
    sqb,
    sqh,
    sqn,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdb,
    sdh,
    sdn,
    sdd,
    slob,
    slnb,
    slnh,
    H,
    GROUP,
    N,
    D,
    G,
    scale,
    HAS_PRIOR: tl.constexpr,
    HAS_MU: tl.constexpr,
    HAS_SSMAX: tl.constexpr,
    BEFORE: tl.constexpr,
    SKIP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dq of one query block, and its rows' terms of the per-head θα, θβ, θμ, s gradients."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # base offsets b·stride, bh·N·D can pass 2^31
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP  # the key/value head of query head h
    q_start = pid_m * BLOCK_M
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < N
    lo_m = tl.load(LO + b * slob + offs_m, mask=row_ok, other=0)
    q = _load_rows(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, sqd, N, D, UPCAST)
    do = _load_rows(DO + b * sdb + h * sdh, offs_m, offs_d, sdn, sdd, N, D, UPCAST)
    m2 = tl.load(STATS + (pid_bh * N + offs_m) * 2, mask=row_ok, other=0.0)
    l2 = tl.load(STATS + (pid_bh * N + offs_m) * 2 + 1, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + pid_bh * N + offs_m, mask=row_ok, other=0.0)
    f, c, log_n = _row_scales(LOGN + b * slnb + h * slnh, S + h, offs_m, N, scale, HAS_SSMAX, BLOCK_M)
    # The head's tables: the prior (log2 units), then its derivatives per unit dL/dprior.
    prior_tab = TABLE + h * N
    alpha_tab = prior_tab + H * N
    beta_tab = alpha_tab + H * N
    mu_tab = beta_tab + H * N

    # dL/dlogits @ k, without the row factor scale·c (applied at the end, so the q·k part of dL/ds
    # is a row dot product of q with it rather than a product per score).
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Per-row sums over the keys of dL/dlogits times each table; the host sums the rows.
    g_alpha = tl.zeros([BLOCK_M], tl.float32)
    g_beta = tl.zeros([BLOCK_M], tl.float32)
    g_mu = tl.zeros([BLOCK_M], tl.float32)
    g_prior = tl.zeros([BLOCK_M], tl.float32)
    rest = tl.zeros([BLOCK_M], tl.float32)  # Σ_j dL/dlogits: 0 in exact arithmetic
    k_lo = (tl.load(LO + b * slob + q_start) // BLOCK_N) * BLOCK_N
    k_hi = tl.minimum(q_start + BLOCK_M, N)
    if SKIP:  # the key tiles at either end whose every score is 0 (live_ranges, from the final maxima)
        first, end = _live_span(LIVE + pid_bh * tl.cdiv(N, G) * 2, q_start, tl.minimum(q_start + BLOCK_M, N), G)
        k_lo = tl.maximum(k_lo, (first // BLOCK_N) * BLOCK_N)
        k_hi = tl.minimum(k_hi, end)
    for k_start in range(k_lo, k_hi, BLOCK_N):
        offs_n = k_start + tl.arange(0, BLOCK_N)
        k = _load_rows(K + b * skb + hk * skh, offs_n, offs_d, skn, skd, N, D, UPCAST)
        v = _load_rows(V + b * svb + hk * svh, offs_n, offs_d, svn, svd, N, D, UPCAST)
        logits, prior, allowed = tile(
            q, k, offs_m, offs_n, lo_m, N, f, c, prior_tab, HAS_PRIOR, HAS_SSMAX, BEFORE, PRECISION
        )
        p = tl.exp2(logits - m2[:, None] - l2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        # Softmax backward with the row term D_i = rowsum(dO⊙O): a key-tiled kernel never holds a
        # whole row of p. dlogits is exactly 0 on masked entries (p = 0 there).
        dlogits = p * (dp - delta[:, None])
        dq += tl.dot(dlogits.to(k.dtype), k, input_precision=PRECISION)
        rest += tl.sum(dlogits, 1)
        if HAS_PRIOR:
            offset = offs_m[:, None] - offs_n[None, :]
            g_alpha += tl.sum(dlogits * tl.load(alpha_tab + offset, mask=allowed, other=0.0), 1)
            g_beta += tl.sum(dlogits * tl.load(beta_tab + offset, mask=allowed, other=0.0), 1)
            if HAS_MU:
                g_mu += tl.sum(dlogits * tl.load(mu_tab + offset, mask=allowed, other=0.0), 1)
            if HAS_SSMAX and not BEFORE:
                g_prior += tl.sum(dlogits * prior, 1)

    # Every row sum centred on the row's largest logit (key j*): Σ_j dS_ij·(X_ij - X_ij*).
    top = tl.load(TOP + pid_bh * N + offs_m, mask=row_ok, other=0)
    dq -= rest[:, None] * _load_rows(K + b * skb + hk * skh, top, offs_d, skn, skd, N, D, UPCAST).to(tl.float32)
    if HAS_PRIOR:
        at = tl.where(row_ok, offs_m - top, 0)  # the offset i - j* (>= 0)
        g_alpha -= rest * tl.load(alpha_tab + at)
        g_beta -= rest * tl.load(beta_tab + at)
        if HAS_MU:
            g_mu -= rest * tl.load(mu_tab + at)
        if HAS_SSMAX and not BEFORE:
            g_prior -= rest * tl.load(prior_tab + at)

    # Chain rule through c = s·ln n_i (see the reference's backward): it scales q·k and, unless
    # SSMax comes before the prior, the prior, whose θ gradients then carry c too.
    g_s = log_n  # 0 without SSMax
    if HAS_SSMAX:
        # q loaded again rather than kept: held through the loop it would cost BLOCK_M·BLOCK_D
        # registers across the whole loop (spills).
        q = _load_rows(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, sqd, N, D, True)
        g_s = log_n * scale * tl.sum(q * dq, 1)
        if HAS_PRIOR and not BEFORE:
            g_s += log_n * g_prior * LN2_C  # the prior table is in log2 units
            g_alpha *= c
            g_beta *= c
            g_mu *= c
    tl.store(
        DQ + pid_bh * N * D + offs_m[:, None] * D + offs_d[None, :],
        (dq * (scale * c)[:, None]).to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d[None, :] < D),
    )
    part = PARTIAL + (pid_bh * N + offs_m) * 4
    tl.store(part + 0, g_alpha, mask=row_ok)
    tl.store(part + 1, g_beta, mask=row_ok)
    tl.store(part + 2, g_mu, mask=row_ok)
    tl.store(part + 3, g_s, mask=row_ok)


def _strides(t: Tensor):
    return tuple(t.stride())


def prior_tables(alpha, beta, mu, n: int, device, weights: bool = False, mu_weights: bool = True) -> Tensor:
    """(T, H, n) fp32, the prior's tables over the offsets i - j = 0..n-1 of a causal row (the prior
    depends on the offset only; O(n·H) work per call instead of transcendentals per score): [0] the
    prior (kernels/bam_attention.py::prior_terms) times log2(e), the kernels' logit units; with
    `weights` also its derivatives (prior_weights at dL/dprior = 1), [1] θα's, [2] θβ's and, with θμ
    and `mu_weights`, [3] μ's, which the dq kernel sums against dL/dlogits per row."""
    p = bam_params(torch.float32, (alpha, beta, mu, None), False, 1.0)
    prior = prior_terms(p, -torch.arange(n, device=device))
    tables = [prior[0] * LOG2E]
    if weights:
        da, db, dm = prior_weights(1.0, prior, p)
        tables += [da, db] + ([dm] if dm is not None and mu_weights else [])
    return torch.stack(tables).contiguous()


def skip_group(n: int) -> int:
    """Rows (and keys) per group of live_ranges' tables: at most 256 groups a side."""
    return INTERPRET_BLOCK if INTERPRET else max(64, triton.next_power_of_2(triton.cdiv(n, 256)))


def live_ranges(q, k, prior, c, scale: float, row_max, scaled: bool, group: int) -> tuple[Tensor, Tensor]:
    """((B, H, R, 2), (B, H, R, 2)) int32: for each group of `group` query rows the span [first, end)
    of keys outside which every score is 0 after exp2, and for each group of keys the span of query
    rows likewise; the kernels leave out the tiles outside them (bit-identical: they would add 0).

    A score of row i and key j is at most ‖q_i‖·|f_i|·‖k_j‖ (f_i = scale·log2(e)·c_i, c_i = SSMax's
    factor or 1) plus the prior's largest value over the pair of groups' offsets (times c_i >= 0 when
    SSMax scales the prior: `scaled`), with a relative slack for the kernels' rounding; a pair of
    groups is empty when that bound is more than UNDERFLOW below the least `row_max` (B, H, N, log2
    units; a lower bound of each row's largest logit) of its rows. `prior` (H, N): the prior's table
    (log2 units) over the offsets i - j = 0..N-1; c (B or 1, H, N) or None."""
    B, H, N, _ = q.shape
    R = triton.cdiv(N, group)

    def grouped(x: Tensor, fill: float, largest: bool) -> Tensor:  # (.., N) -> (.., R)
        x = torch.nn.functional.pad(x, (0, R * group - N), value=fill).unflatten(-1, (R, group))
        return x.amax(-1) if largest else x.amin(-1)

    c = torch.ones(1, H, N, device=q.device) if c is None else c
    f = (c * (scale * LOG2E)).abs()
    # Norms rounded up by a part in a million: the bound must hold for the values the dots see.
    # Norms in fp32 without an fp32 copy of q or k (this runs on every call).
    q_norm = torch.linalg.vector_norm(q, dim=-1, dtype=torch.float32)
    k_norm = torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32)
    q_bound = grouped(q_norm * f * (1 + 1e-6), 0.0, True)
    k_bound = grouped(k_norm * (1 + 1e-6), 0.0, True).repeat_interleave(H // k.shape[1], 1)
    c_min = grouped(c.expand(B, H, N), math.inf, False)
    m_min = grouped(row_max, math.inf, False)
    # The prior's largest value over the offsets of row group r against key group r - d, for each d:
    # offsets d·G - G + 1 .. d·G + G - 1 (negative ones are masked scores: -inf).
    padded = torch.nn.functional.pad(prior, (group - 1, R * group + group - N), value=-math.inf)
    p_max = torch.nn.functional.max_pool1d(padded[:, None], 2 * group - 1, stride=group)[:, 0, :R]
    r = torch.arange(R, device=q.device)
    d = r[:, None] - r[None, :]  # (row group, key group)
    prior_bound = p_max[:, d.clamp(min=0)][None]  # (1, H, R, R)
    if scaled:
        prior_bound = prior_bound * c_min[..., None]
    qk = q_bound[..., :, None] * k_bound[..., None, :]
    bound = qk + prior_bound + 1e-3 * (qk.abs() + prior_bound.abs()) + UNDERFLOW
    live = ~((bound < m_min[..., None]) & (c_min[..., None] >= 0)) & (d >= 0)

    def spans(axis: int) -> Tensor:
        index = r.view([-1 if a == axis else 1 for a in range(-2, 0)])
        first = torch.where(live, index, R).amin(axis)
        last = torch.where(live, index, -1).amax(axis)
        return torch.stack([first * group, (last + 1) * group], -1).to(torch.int32).contiguous()

    return spans(-1), spans(-2)


def _skip_inputs(q, k, rows: tuple, scale: float, before: bool, row_max: Tensor | None = None) -> dict:
    """The LIVE table (live_ranges' key spans, or its row spans with `rows_of_keys`) and G for a
    launch: the forward's from each row's diagonal logit, a lower bound of its max (always allowed),
    the backward's from `row_max`, the forward's maxima. Placeholders with SKIP off (no prior)."""
    _, table, s = rows
    if table is q or not SKIP_EMPTY_TILES:
        return dict(key_spans=q, row_spans=q, G=1)
    B, H, N, _ = q.shape
    c = None
    if s is not q:  # SSMax: c_i = s·ln n_i
        c = s[None, :, None] * rows[0]
    scaled = c is not None and not before
    if row_max is None:
        # q_i·k_i per query head, its group's key/value head read in place (no copy of k per head).
        qk = torch.einsum("bkgnd,bknd->bkgn", q.float().unflatten(1, (k.shape[1], H // k.shape[1])), k.float())
        qk = qk.flatten(1, 2) * (scale * LOG2E) * (1.0 if c is None else c)
        prior = table[0, :, :1][None] * (c if scaled else 1.0)  # offset 0
        row_max = qk + prior - 1e-3 * (qk.abs() + prior.abs())
    group = skip_group(N)
    key_spans, row_spans = live_ranges(q, k, table[0], c, scale, row_max, scaled, group)
    return dict(key_spans=key_spans, row_spans=row_spans, G=group)


def _row_inputs(q: Tensor, lo: Tensor, alpha, beta, mu, s, key_cap=None, **tables) -> tuple:
    """(LOGN, TABLE, S) launch arguments: ln n_i per row (B or 1, 1, N), or per head (B or 1, H, N) at
    most ln of its `key_cap` (AttentionOptions.ssmax_key_cap), and s with SSMax; the prior's tables
    with a prior; q in place of those absent (their flags are off, they are never read)."""
    N = q.shape[2]
    log_n = None
    if s is not None:
        log_n = key_count_log(lo, torch.arange(N, device=q.device), torch.float32)[:, None, :, None]
        log_n = capped_log(log_n, None if key_cap is None else key_cap.detach())[..., 0].contiguous()
    table = None if alpha is None else prior_tables(alpha, beta, mu, N, q.device, **tables)
    s = None if s is None else s.detach().float().contiguous()
    return tuple(q if t is None else t for t in (log_n, table, s))


def _launch_args(q, k, lo, alpha, s, rows: tuple):
    """Arguments shared by the three kernels' launches (shapes, feature flags, dot precision, the
    strides of the row tables: 0 along an axis a table shares)."""
    B, H, N, D = q.shape
    log_n = rows[0]
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 inputs: no TF32 rounding
    return dict(
        H=H,
        GROUP=H // k.shape[1],
        N=N,
        D=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        UPCAST=INTERPRET,
        PRECISION=precision,
        HAS_PRIOR=alpha is not None,
        HAS_SSMAX=s is not None,
        SKIP=alpha is not None and SKIP_EMPTY_TILES,
        slob=lo.stride(0) if lo.shape[0] > 1 else 0,
        slnb=log_n.stride(0) if s is not None and log_n.shape[0] > 1 else 0,
        slnh=log_n.stride(1) if s is not None and log_n.shape[1] > 1 else 0,
    )


def forward(
    q,
    k,
    v,
    lo,
    alpha,
    beta,
    mu,
    s,
    ssmax_before_prior: bool,
    scale: float,
    out: Tensor,
    stats: Tensor,
    top: Tensor,
    key_cap: Tensor | None = None,
) -> None:
    """Fill out (B, H, N, BLOCK_D) fp32, stats (B, H, N, 2) fp32 (each row's logit max and log2 of its
    sum, log2 units) and top (B, H, N) int32 (the key of the max); lo (B or 1, N) int32 key starts;
    key_cap (H,) or None: SSMax's key cap per head. k, v may have H_kv | H heads (query head h reads
    head h // (H // H_kv))."""
    B, H, N, _ = q.shape
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * H)  # noqa: E731
    rows = _row_inputs(q, lo, alpha, beta, mu, s, key_cap)
    skip = _skip_inputs(q, k, rows, scale, ssmax_before_prior)
    fwd_kernel[grid](
        q,
        k,
        v,
        out,
        stats,
        top,
        lo,
        *rows,
        skip["key_spans"],
        *_strides(q),
        *_strides(k),
        *_strides(v),
        scale=scale,
        G=skip["G"],
        BEFORE=ssmax_before_prior,
        **_launch_args(q, k, lo, alpha, s, rows),
    )


def backward(
    q,
    k,
    v,
    out,
    dout,
    stats,
    top,
    lo,
    last,
    alpha,
    beta,
    mu,
    s,
    ssmax_before_prior: bool,
    scale: float,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    mu_grad: bool = True,
    key_cap: Tensor | None = None,
) -> Tensor:
    """Fill dq (B, H, N, D) and dk, dv (B, H_kv, N, D), contiguous (dk, dv summed over each group's
    query heads); return (H, 4) fp32 gradients of θα, θβ, μ, s (μ's is 0 unless mu_grad: the
    per-element work is skipped when θμ is frozen).

    out is the forward's fp32 output: the row term D_i = rowsum(dO⊙O) needs it in full precision
    (a row with one key otherwise gets rounding noise times the prior's large derivative).
    """
    B, H, N, D = q.shape
    has_mu = mu is not None and mu_grad
    delta = (dout.float() * out[..., :D]).sum(-1).contiguous()
    common = (*_strides(q), *_strides(k), *_strides(v), *_strides(dout))
    rows = _row_inputs(q, lo, alpha, beta, mu, s, key_cap, weights=True, mu_weights=has_mu)
    args = _launch_args(q, k, lo, alpha, s, rows)
    skip = _skip_inputs(q, k, rows, scale, ssmax_before_prior, row_max=stats[..., 0])
    # One program per (key block, batch·kv head), looping over the group's query heads; it reads the
    # prior's table only (the first of the tables).
    bwd_dkdv_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), B * k.shape[1])](
        q,
        k,
        v,
        dout,
        stats,
        delta,
        lo,
        last,
        dk,
        dv,
        *rows,
        skip["row_spans"],
        *common,
        scale=scale,
        G=skip["G"],
        BEFORE=ssmax_before_prior,
        **args,
    )
    # dL/d(θα, θβ, μ, s) of each row, summed here: every row is written once whatever the tile size
    # (autotuning tries several), and the sum is deterministic unlike atomics.
    partial = torch.empty(B, H, N, 4, dtype=torch.float32, device=q.device)
    bwd_dq_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * H)](
        q,
        k,
        v,
        dout,
        stats,
        top,
        delta,
        lo,
        dq,
        partial,
        *rows,
        skip["key_spans"],
        *common,
        scale=scale,
        G=skip["G"],
        HAS_MU=has_mu,
        BEFORE=ssmax_before_prior,
        **args,
    )
    return partial.sum((0, 2))


class _BAMAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alpha, beta, mu, s, lo, last, ssmax_before_prior, scale, key_cap):
        B, H, N, D = q.shape
        out = torch.empty(B, H, N, max(16, triton.next_power_of_2(D)), dtype=torch.float32, device=q.device)
        stats = torch.empty(B, H, N, 2, dtype=torch.float32, device=q.device)
        top = torch.empty(B, H, N, dtype=torch.int32, device=q.device)
        forward(q, k, v, lo, alpha, beta, mu, s, ssmax_before_prior, scale, out, stats, top, key_cap)
        ctx.save_for_backward(q, k, v, out, stats, top, lo, last, alpha, beta, mu, s, key_cap)
        ctx.cfg = (ssmax_before_prior, scale)
        return out[..., :D].to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, stats, top, lo, last, alpha, beta, mu, s, key_cap = ctx.saved_tensors
        ssmax_before_prior, scale = ctx.cfg
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        heads = backward(
            q,
            k,
            v,
            out,
            dout,
            stats,
            top,
            lo,
            last,
            alpha,
            beta,
            mu,
            s,
            ssmax_before_prior,
            scale,
            dq,
            dk,
            dv,
            mu_grad=ctx.needs_input_grad[5],
            key_cap=key_cap,
        )
        da, db, dm, ds = heads.unbind(1)
        if mu is not None:
            dm = dm * 2 * torch.cosh(mu.detach().float())
        grads = zip((dq, dk, dv, da, db, dm, ds), (q, k, v, alpha, beta, mu, s))
        return (
            *(g.to(t.dtype) if ctx.needs_input_grad[i] else None for i, (g, t) in enumerate(grads)),
            None,
            None,
            None,
            None,
            None,
        )


def key_bounds(doc_ids: Tensor | None, window: int | None, n: int, device) -> tuple[Tensor, Tensor]:
    """(lo, last), (B or 1, N) int32 each: row i sees keys lo[i]..i, key j is seen by rows j..last[j]-1."""
    lo = key_start(doc_ids, window, n, device).contiguous()
    last = torch.searchsorted(lo, torch.arange(n, device=device).expand_as(lo).contiguous(), right=True)
    return lo.to(torch.int32), last.to(torch.int32)


def bam_attention_triton(q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions = AttentionOptions()) -> Tensor:
    """kernels.bam_attention.bam_attention as fused Triton kernels (same arguments and result).

    q: (B, H, N, D), k, v: (B, H_kv, N, D) with H_kv dividing H (grouped-query attention: query head
    h reads head h // (H // H_kv)), fp32, fp16 or bf16 (any strides); computed with fp32
    accumulation and returned in q's dtype; dk, dv have k's and v's shape. `options.block_size` is
    not read: the kernels' tiles come from autotuning (16 when interpreting).
    """
    options.check(q, k, v)
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"the Triton BAM kernel takes fp32, fp16 or bf16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    N, D = q.shape[-2:]
    lo, last = key_bounds(options.doc_ids, options.window, N, q.device)
    return _BAMAttentionTriton.apply(
        q,
        k,
        v,
        *options.head_tensors,
        lo,
        last,
        options.ssmax_before_prior,
        options.head_scale(D),
        options.ssmax_key_cap,
    )
