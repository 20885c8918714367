"""BAM attention (GGD prior + SSMax, causal, documents, sliding window) as fused Triton kernels.

Same semantics as the pure-PyTorch reference (kernels/bam_attention.py), flash-attention style: the
forward walks the key tiles of each query block with an online softmax and saves the row
log-sum-exp; the prior is evaluated per tile from the per-head θ, so no N×N tensor exists. Key tiles
outside a row block's causal / document / window range are skipped by the loop bounds, so with a
window the cost is N·w. The backward recomputes each tile twice: once per key block (dk, dv) and
once per query block (dq and the per-head gradients of θα, θβ, θμ, s, written as one partial sum per
row and reduced afterwards, so the result is deterministic).

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

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from megabam.kernels.bam_attention import EPS, EXP_CAP, AttentionOptions, key_start

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter runs ~1-3 ms per tile iteration whatever the tile size, and autotune with more than
# one config fails there: one small config when interpreting, a few tuned ones on the GPU.
INTERPRET_BLOCK = 16
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The reference's constants, as constexpr globals (the only globals a compiled kernel may read).
EPS_C = tl.constexpr(EPS)
EXP_CAP_C = tl.constexpr(EXP_CAP)


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
def _head_scalars(ALPHA, BETA, MU, S, h, HAS_PRIOR: tl.constexpr, HAS_SSMAX: tl.constexpr):
    """Head h's θα, θβ, μ and s (fp32); 0 in place of those whose feature is off (never read)."""
    alpha = 0.0
    beta = 0.0
    mu = 0.0
    s = 0.0
    if HAS_PRIOR:
        alpha = tl.load(ALPHA + h)
        beta = tl.load(BETA + h)
        mu = tl.load(MU + h)
    if HAS_SSMAX:
        s = tl.load(S + h)
    return alpha, beta, mu, s


@triton.jit
def tile(
    q,
    k,
    offs_m,
    offs_n,
    lo_m,
    n,
    alpha,
    beta,
    mu,
    s,
    scale,
    HAS_PRIOR: tl.constexpr,
    HAS_SSMAX: tl.constexpr,
    BEFORE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Masked logits of query rows offs_m against keys offs_n, as the reference's block_logits.

    Returns (logits, qk, prior, log_a, live, d, log_n); logits are -inf where not allowed. The prior
    terms are placeholders (qk) without a prior, log_n one without SSMax: the caller's constexpr
    flags say which are real.
    """
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    logits = qk
    prior = qk
    log_a = qk
    d = qk
    live = qk == qk
    if HAS_PRIOR:
        # Same arithmetic as kernels/bam_attention.py::prior_terms, in log space so nothing overflows.
        d = (offs_n[None, :] - offs_m[:, None]).to(tl.float32) - mu
        log_a = tl.log(tl.abs(d) + EPS_C)
        expo = alpha + beta * log_a
        live = expo < EXP_CAP_C
        prior = -tl.exp(tl.minimum(expo, EXP_CAP_C))
        logits = qk + prior
    log_n = lo_m.to(tl.float32)
    if HAS_SSMAX:
        log_n = tl.log((offs_m - lo_m + 1).to(tl.float32))
        c = s * log_n[:, None]
        if HAS_PRIOR and BEFORE:
            logits = qk * c + prior
        else:
            logits = logits * c
    allowed = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] >= lo_m[:, None]) & (offs_m[:, None] < n)
    logits = tl.where(allowed, logits, float("-inf"))
    return logits, qk, prior, log_a, live, d, log_n


@triton.autotune(configs=_configs([(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2)]), key=_TUNE_KEY)
@triton.jit
def fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    LO,
    ALPHA,
    BETA,
    MU,
    S,
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
    H,
    GROUP,
    N,
    D,
    scale,
    HAS_PRIOR: tl.constexpr,
    HAS_SSMAX: tl.constexpr,
    BEFORE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Output rows and row log-sum-exp of one query block of one (batch, query head)."""
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
    alpha, beta, mu, s = _head_scalars(ALPHA, BETA, MU, S, h, HAS_PRIOR, HAS_SSMAX)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # lo is non-decreasing in the row, so the block's first row has the earliest key.
    k_lo = (tl.load(LO + b * slob + q_start) // BLOCK_N) * BLOCK_N
    k_hi = tl.minimum(q_start + BLOCK_M, N)
    for k_start in range(k_lo, k_hi, BLOCK_N):
        offs_n = k_start + tl.arange(0, BLOCK_N)
        k = _load_rows(K + b * skb + hk * skh, offs_n, offs_d, skn, skd, N, D, UPCAST)
        v = _load_rows(V + b * svb + hk * svh, offs_n, offs_d, svn, svd, N, D, UPCAST)
        logits = tile(
            q, k, offs_m, offs_n, lo_m, N, alpha, beta, mu, s, scale, HAS_PRIOR, HAS_SSMAX, BEFORE, PRECISION
        )[0]
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        # A row may have no allowed key in this tile yet (document or window start further on):
        # subtract 0 then, so exp() gives 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(logits - m_safe[:, None])
        corr = tl.exp(m_i - m_safe)
        l_i = l_i * corr + tl.sum(p, 1)
        acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    row_ok = offs_m < N
    l_i = tl.where(row_ok, l_i, 1.0)  # padding rows saw nothing; keep them finite
    o_ptr = O + pid_bh * N * BLOCK_D + offs_m[:, None] * BLOCK_D + offs_d[None, :]
    tl.store(o_ptr, acc / l_i[:, None], mask=row_ok[:, None])
    tl.store(LSE + pid_bh * N + offs_m, m_i + tl.log(l_i), mask=row_ok)


# GROUP in the key: with grouped-query attention the dk/dv grid has GROUP times fewer, longer programs.
@triton.autotune(configs=_configs([(64, 128, 8, 2), (64, 64, 4, 2), (32, 128, 4, 2)]), key=_TUNE_KEY + ["GROUP"])
@triton.jit
def bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    LO,
    LAST,
    DK,
    DV,
    ALPHA,
    BETA,
    MU,
    S,
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
    H,
    GROUP,
    N,
    D,
    scale,
    HAS_PRIOR: tl.constexpr,
    HAS_SSMAX: tl.constexpr,
    BEFORE: tl.constexpr,
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
        pid_bh = b * H + h  # its row of LSE and DELTA
        alpha, beta, mu, s = _head_scalars(ALPHA, BETA, MU, S, h, HAS_PRIOR, HAS_SSMAX)
        for q_start in range(q_lo, q_hi, BLOCK_M):
            offs_m = q_start + tl.arange(0, BLOCK_M)
            row_ok = offs_m < N
            lo_m = tl.load(LO + b * slob + offs_m, mask=row_ok, other=0)
            q = _load_rows(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, sqd, N, D, UPCAST)
            do = _load_rows(DO + b * sdb + h * sdh, offs_m, offs_d, sdn, sdd, N, D, UPCAST)
            lse = tl.load(LSE + pid_bh * N + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + pid_bh * N + offs_m, mask=row_ok, other=0.0)
            logits, qk, prior, log_a, live, d, log_n = tile(
                q, k, offs_m, offs_n, lo_m, N, alpha, beta, mu, s, scale, HAS_PRIOR, HAS_SSMAX, BEFORE, PRECISION
            )
            p = tl.exp(logits - lse[:, None])
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            dqk = p * (dp - delta[:, None])
            if HAS_SSMAX:
                dqk = dqk * (s * log_n[:, None])
            dk += tl.dot(tl.trans(dqk).to(q.dtype), q, input_precision=PRECISION)

    col_ok = (offs_n[:, None] < N) & (offs_d[None, :] < D)
    out = pid_bhk * N * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=col_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.autotune(configs=_configs([(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 4, 2)]), key=_TUNE_KEY)
@triton.jit
def bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    LO,
    DQ,
    PARTIAL,
    ALPHA,
    BETA,
    MU,
    S,
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
    H,
    GROUP,
    N,
    D,
    scale,
    HAS_PRIOR: tl.constexpr,
    HAS_MU: tl.constexpr,
    HAS_SSMAX: tl.constexpr,
    BEFORE: tl.constexpr,
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
    lse = tl.load(LSE + pid_bh * N + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + pid_bh * N + offs_m, mask=row_ok, other=0.0)
    alpha, beta, mu, s = _head_scalars(ALPHA, BETA, MU, S, h, HAS_PRIOR, HAS_SSMAX)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Per-row sums over the keys of dL/dθα, dL/dθβ, dL/dμ and dL/ds; the host sums the rows.
    g_alpha = tl.zeros([BLOCK_M], tl.float32)
    g_beta = tl.zeros([BLOCK_M], tl.float32)
    g_mu = tl.zeros([BLOCK_M], tl.float32)
    g_s = tl.zeros([BLOCK_M], tl.float32)
    k_lo = (tl.load(LO + b * slob + q_start) // BLOCK_N) * BLOCK_N
    k_hi = tl.minimum(q_start + BLOCK_M, N)
    for k_start in range(k_lo, k_hi, BLOCK_N):
        offs_n = k_start + tl.arange(0, BLOCK_N)
        k = _load_rows(K + b * skb + hk * skh, offs_n, offs_d, skn, skd, N, D, UPCAST)
        v = _load_rows(V + b * svb + hk * svh, offs_n, offs_d, svn, svd, N, D, UPCAST)
        logits, qk, prior, log_a, live, d, log_n = tile(
            q, k, offs_m, offs_n, lo_m, N, alpha, beta, mu, s, scale, HAS_PRIOR, HAS_SSMAX, BEFORE, PRECISION
        )
        p = tl.exp(logits - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        # Softmax backward with the row term D_i = rowsum(dO⊙O): a key-tiled kernel never holds a
        # whole row of p. dlogits is exactly 0 on masked entries (p = 0 there).
        dlogits = p * (dp - delta[:, None])
        dqk = dlogits
        dprior = dlogits
        if HAS_SSMAX:
            # Chain rule through c = s·ln n_i (see the reference's backward).
            if HAS_PRIOR and not BEFORE:
                g_s += tl.sum(dlogits * (qk + prior), 1) * log_n
            else:
                g_s += tl.sum(dlogits * qk, 1) * log_n
            dqk = dlogits * (s * log_n[:, None])
            if not BEFORE:
                dprior = dqk
        dq += tl.dot(dqk.to(k.dtype), k, input_precision=PRECISION)
        if HAS_PRIOR:
            g = tl.where(live, dprior * prior, 0.0)  # dL/d(exponent θα + θβ·ln(|d|+ε))
            g_alpha += tl.sum(g, 1)
            g_beta += tl.sum(g * log_a, 1)
            if HAS_MU:  # d|d|/dμ = -sign(d); d(a^β)/da = β·a^β/a
                sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
                g_mu -= tl.sum(g * beta * sign / (tl.abs(d) + EPS_C), 1)

    tl.store(
        DQ + pid_bh * N * D + offs_m[:, None] * D + offs_d[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d[None, :] < D),
    )
    part = PARTIAL + (pid_bh * N + offs_m) * 4
    tl.store(part + 0, g_alpha, mask=row_ok)
    tl.store(part + 1, g_beta, mask=row_ok)
    tl.store(part + 2, g_mu, mask=row_ok)
    tl.store(part + 3, g_s, mask=row_ok)


def _strides(t: Tensor):
    return tuple(t.stride())


def _head_params(alpha, beta, mu, s, like: Tensor):
    """fp32 per-head (θα, θβ, μ = 2·sinh θμ, s); a placeholder where absent (its flag is off)."""
    f = [None if t is None else t.detach().float().contiguous() for t in (alpha, beta, mu, s)]
    if f[0] is not None and f[2] is None:
        f[2] = torch.zeros_like(f[0])
    elif f[2] is not None:
        f[2] = 2 * torch.sinh(f[2])
    return [like if t is None else t for t in f]


def _launch_args(q, k, lo, heads):
    """Arguments shared by the three kernels' launches (shapes, feature flags, dot precision)."""
    B, H, N, D = q.shape
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 inputs: no TF32 rounding
    return dict(
        H=H,
        GROUP=H // k.shape[1],
        N=N,
        D=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        UPCAST=INTERPRET,
        PRECISION=precision,
        HAS_PRIOR=heads[0] is not None,
        HAS_SSMAX=heads[3] is not None,
        slob=lo.stride(0) if lo.shape[0] > 1 else 0,
    )


def forward(q, k, v, lo, alpha, beta, mu, s, ssmax_before_prior: bool, scale: float, out: Tensor, lse: Tensor) -> None:
    """Fill out (B, H, N, BLOCK_D) fp32 and lse (B, H, N) fp32; lo (B or 1, N) int32 key starts.
    k, v may have H_kv | H heads (query head h reads head h // (H // H_kv))."""
    B, H, N, _ = q.shape
    heads = [alpha, beta, mu, s]
    args = _launch_args(q, k, lo, heads)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * H)  # noqa: E731
    fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        lo,
        *_head_params(*heads, like=lse),
        *_strides(q),
        *_strides(k),
        *_strides(v),
        scale=scale,
        BEFORE=ssmax_before_prior,
        **args,
    )


def backward(
    q,
    k,
    v,
    out,
    dout,
    lse,
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
) -> Tensor:
    """Fill dq (B, H, N, D) and dk, dv (B, H_kv, N, D), contiguous (dk, dv summed over each group's
    query heads); return (H, 4) fp32 gradients of θα, θβ, μ, s (μ's is 0 unless mu_grad: the
    per-element work is skipped when θμ is frozen).

    out is the forward's fp32 output: the row term D_i = rowsum(dO⊙O) needs it in full precision
    (a row with one key otherwise gets rounding noise times the prior's large derivative).
    """
    B, H, N, D = q.shape
    heads = [alpha, beta, mu, s]
    args = _launch_args(q, k, lo, heads)
    delta = (dout.float() * out[..., :D]).sum(-1).contiguous()
    common = (*_strides(q), *_strides(k), *_strides(v), *_strides(dout))
    params = _head_params(*heads, like=lse)
    # One program per (key block, batch·kv head), looping over the group's query heads.
    bwd_dkdv_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), B * k.shape[1])](
        q, k, v, dout, lse, delta, lo, last, dk, dv, *params, *common, scale=scale, BEFORE=ssmax_before_prior, **args
    )
    # dL/d(θα, θβ, μ, s) of each row, summed here: every row is written once whatever the tile size
    # (autotuning tries several), and the sum is deterministic unlike atomics.
    partial = torch.empty(B, H, N, 4, dtype=torch.float32, device=q.device)
    bwd_dq_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * H)](
        q,
        k,
        v,
        dout,
        lse,
        delta,
        lo,
        dq,
        partial,
        *params,
        *common,
        scale=scale,
        HAS_MU=mu is not None and mu_grad,
        BEFORE=ssmax_before_prior,
        **args,
    )
    return partial.sum((0, 2))


class _BAMAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alpha, beta, mu, s, lo, last, ssmax_before_prior, scale):
        B, H, N, D = q.shape
        out = torch.empty(B, H, N, max(16, triton.next_power_of_2(D)), dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, N, dtype=torch.float32, device=q.device)
        forward(q, k, v, lo, alpha, beta, mu, s, ssmax_before_prior, scale, out, lse)
        ctx.save_for_backward(q, k, v, out, lse, lo, last, alpha, beta, mu, s)
        ctx.cfg = (ssmax_before_prior, scale)
        return out[..., :D].to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, lo, last, alpha, beta, mu, s = ctx.saved_tensors
        ssmax_before_prior, scale = ctx.cfg
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        heads = backward(
            q,
            k,
            v,
            out,
            dout,
            lse,
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
        q, k, v, *options.head_tensors, lo, last, options.ssmax_before_prior, options.head_scale(D)
    )
