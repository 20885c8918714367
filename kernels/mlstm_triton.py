"""The chunkwise mLSTM cell (kernels/mlstm.py::mlstm_chunkwise) as Triton kernels, forward and backward.

TFLA-style split, with the reference's stabiliser (m_t, the row maximum of the log weights) exactly:
- `fwd_state_kernel`, one program per (batch·head, d_v tile): walks the chunks in order and writes
  the state (C, n, m) at every chunk start, the final state last; on this sequential path it forms
  only each chunk's last row of log weights (the new state's keys and stabiliser), not D;
- `fwd_chunk_kernel`, one program per (chunk, batch·head, d_v tile): the chunk's scores against its
  own keys (log-gate matrix D_ts = b_t - b_s + i_s, b the chunk-local cumulative log forget gate),
  plus the carried state, stabilised by the row max; writes h and each row's q̃·n and m;
- `bwd_state_kernel`, per (batch·head, d_v tile): walks the chunks backwards, writing the gradient
  of every chunk-start state (C, n) and the gradient reaching each chunk-start stabiliser m;
- `bwd_chunk_kernel`, per (chunk, batch·head): dq, dk, dv and the gradients of i and of b.
The host does the O(N) elementwise parts: log-sigmoid and chunk-local cumsum of f, the row terms of
the output's denominator, and d(lf) = reverse cumsum of db within chunks, df = d(lf)·σ(-f).

The backward is exact, not the usual "stabiliser has no gradient" shortcut. In true (unscaled)
terms h_t = num_t / (max(|q̃_t·n_t|, 1) + eps·exp(m_t)) and the final state is returned scaled by
exp(-m_N), so the output depends on the stabilisers m_t explicitly: dL/dm_t = eps·dden_t for every
row (dden = -(dh·h)/den), plus dm_N - ΣdC_N⊙C_N - Σdn_N⊙n_N at the last row. Each m_t is a max, so
that gradient goes to its argmax: a key's log weight D_ts (→ b_t, b_s, i_s) or the carried state's
b_t + m_c, m_c being the previous chunk's last row, which makes the reverse scalar recurrence
the state kernel carries. Ties are split as torch.maximum / amax split them. The term is not small:
dropping it (m treated as a constant) put di and df off the reference by 2e-2 and 6e-2 relative
with random gates, 0.17 and 7e-2 with gates spread over ±15 (N = 37, chunk 16, gradients on h and
on the final state), against under 1e-5 with it.

Memory: the forward keeps the state at every chunk start, (B, H, N/chunk + 1, d_qk, d_v) fp32, and h
in fp32 for the backward's row terms; the backward allocates the state gradients alike.

Everything is computed in fp32 (the state always is): q, k, v are upcast when loaded, and dots of
fp16/bf16 inputs run as TF32 on the GPU, fp32 inputs as exact fp32 (the model feeds its own dtype). Plain
pointer arithmetic only, so one source runs under the GPU image's Triton 3.6 and the CPU
interpreter of the pinned Triton 3.9 (TRITON_INTERPRET=1, read at import; one autotune config there).
Offsets are int64 wherever they can pass 2^31: batch·head indices are widened once per program and
position vectors before they multiply a row stride (in _load_tile: a (B, N, H, d) view's row stride
is H·d); the small within-tile offsets (d_qk·d_v) stay int32.
Every buffer the kernels write is fully written (tested with NaN-filled buffers); reductions are
per program in a fixed order (deterministic, no atomics).
"""

import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from megabam.kernels.mlstm import MLstmState

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TUNE_KEY = ["N", "DQK", "DV", "CHUNK"]


def _configs(triples):
    """(BLOCK_DV, num_warps, num_stages) configs; one small one when interpreting (autotuning with
    several fails there, and the interpreter's cost is per tile, not per element)."""
    if INTERPRET:
        return [triton.Config({"BLOCK_DV": 16})]
    return [triton.Config({"BLOCK_DV": bv}, num_warps=w, num_stages=s) for bv, w, s in triples]


@triton.jit
def _load_tile(ptr, rows, cols, stride_r, stride_c, n_rows, n_cols):
    """fp32 (len(rows), len(cols)) tile of a strided matrix; zeros outside. The row index vector is
    widened to int64 before it meets the stride: a (B, N, H, d) view's row stride is H·d, so
    position·stride passes 2^31 on long sequences."""
    x = tl.load(
        ptr + rows.to(tl.int64)[:, None] * stride_r + cols[None, :] * stride_c,
        mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols),
        other=0.0,
    )
    return x.to(tl.float32)


@triton.jit
def _gates(B_LOG, I, bh, c, N, CHUNK: tl.constexpr, BLOCK_L: tl.constexpr):
    """Gates of chunk c of batch·head bh: offs (positions), r (local index), valid, b, i, last (local
    index of the last step) and b_last (b there)."""
    r = tl.arange(0, BLOCK_L)
    offs = c * CHUNK + r
    valid = (r < CHUNK) & (offs < N)
    b = tl.load(B_LOG + bh * N + offs, mask=valid, other=0.0)
    i = tl.load(I + bh * N + offs, mask=valid, other=0.0)
    last = tl.minimum(CHUNK, N - c * CHUNK) - 1
    b_last = tl.sum(tl.where(r == last, b, 0.0), 0)
    return offs, r, valid, b, i, last, b_last


@triton.jit
def _stabilise(r, valid, b, i, m_c):
    """Log weights and row stabilisers of a chunk (its _gates), computed the same way (bit for bit)
    in every kernel that needs all rows; m_c is the incoming state's stabiliser.

    Returns D (log weights, -inf off the causal part), carried (b + m_c), the intra-chunk row max,
    and m_row (the row stabiliser; 0 on padding rows). _last_row_stabiliser gives m_row[last] alone.
    """
    causal = (r[None, :] <= r[:, None]) & valid[None, :] & valid[:, None]
    D = tl.where(causal, (b[:, None] - b[None, :]) + i[None, :], float("-inf"))
    carried = b + m_c
    intra = tl.max(D, 1)
    m_row = tl.where(valid, tl.maximum(carried, intra), 0.0)
    return D, carried, intra, m_row


@triton.jit
def _last_row_stabiliser(valid, b, i, b_last, m_c):
    """The chunk's last row of log weights, col_s = D_last,s (-inf on padding), and that row's
    stabiliser m_row[last]: the same operations on the same values as _stabilise (b_last is b[last]
    exactly, and every valid step is causal for the last row; max is exact in any order), so the
    state kernel's m equals the chunk kernels' bit for bit without forming D."""
    col = tl.where(valid, (b_last - b) + i, float("-inf"))
    return col, tl.maximum(b_last + m_c, tl.max(col, 0))


@triton.autotune(configs=_configs([(64, 4, 1), (128, 8, 1)]), key=_TUNE_KEY)
@triton.jit
def fwd_state_kernel(
    K,
    V,
    B_LOG,
    I,
    C0,
    N0,
    STATE_C,
    STATE_N,
    STATE_M,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    H,
    N,
    DQK,
    DV,
    NC,
    HAS_STATE: tl.constexpr,
    PRECISION: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """States at every chunk start (index c) and the final state (index NC); STATE_M[:, 0] is given."""
    bh = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1)
    bb = bh // H
    hh = bh % H
    offs_k = tl.arange(0, BLOCK_DQK)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    kv = offs_k[:, None] * DV + offs_v[None, :]
    kv_ok = (offs_k[:, None] < DQK) & (offs_v[None, :] < DV)
    first = pid_v == 0  # n and m do not depend on the d_v tile: one program writes them
    n_ok = offs_k < tl.where(first, DQK, 0)
    if HAS_STATE:
        C = tl.load(C0 + bh * DQK * DV + kv, mask=kv_ok, other=0.0)
        n = tl.load(N0 + bh * DQK + offs_k, mask=offs_k < DQK, other=0.0)
    else:
        C = tl.zeros([BLOCK_DQK, BLOCK_DV], tl.float32)
        n = tl.zeros([BLOCK_DQK], tl.float32)
    m_c = tl.load(STATE_M + bh * (NC + 1))  # each program carries m itself: no cross-program reads
    for c in range(0, NC):
        st = bh * (NC + 1) + c
        tl.store(STATE_C + st * DQK * DV + kv, C, mask=kv_ok)
        tl.store(STATE_N + st * DQK + offs_k, n, mask=n_ok)
        offs, r, valid, b, i, last, b_last = _gates(B_LOG, I, bh, c, N, CHUNK, BLOCK_L)
        # The last row's stabiliser, as fwd_chunk_kernel computes it: the new state's scale.
        col, m_new = _last_row_stabiliser(valid, b, i, b_last, m_c)
        k = _load_tile(K + bb * skb + hh * skh, offs, offs_k, skn, skd, N, DQK) * tl.exp(col - m_new)[:, None]
        v = _load_tile(V + bb * svb + hh * svh, offs, offs_v, svn, svd, N, DV)
        decay = tl.exp(b_last + m_c - m_new)  # 0 for an empty incoming state (m_c = -inf)
        C = decay * C + tl.dot(tl.trans(k), v, input_precision=PRECISION)
        n = decay * n + tl.sum(k, 0)
        if first:  # a scalar store takes no mask under the interpreter
            tl.store(STATE_M + st + 1, m_new)
        m_c = m_new
    st = bh * (NC + 1) + NC
    tl.store(STATE_C + st * DQK * DV + kv, C, mask=kv_ok)
    tl.store(STATE_N + st * DQK + offs_k, n, mask=n_ok)


def _no_wide_fp32_tiles(configs, named_args, **kwargs):
    """Measured on an H200 (Triton 3.6, torch 2.11): fwd_chunk_kernel with BLOCK_DV 128 (8 warps, 2
    stages) on fp32 inputs at d_qk 128 faults with a misaligned address; bf16 inputs and d_qk ≤ 64 run.
    fp32 inputs keep the 64-wide tile."""
    if {**named_args, **kwargs}.get("PRECISION") != "ieee":
        return configs
    return [c for c in configs if c.kwargs["BLOCK_DV"] < 128]


@triton.autotune(
    configs=_configs([(64, 4, 2), (128, 8, 2)]),
    key=_TUNE_KEY + ["PRECISION"],
    prune_configs_by={"early_config_prune": _no_wide_fp32_tiles},
)
@triton.jit
def fwd_chunk_kernel(
    Q,
    K,
    V,
    B_LOG,
    I,
    STATE_C,
    STATE_N,
    STATE_M,
    H_OUT,
    QN,
    M_ROW,
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
    H,
    N,
    DQK,
    DV,
    NC,
    scale,
    eps,
    PRECISION: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """h of one chunk's rows (one d_v tile), and the rows' q̃·n and m (same in every tile)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    pid_v = tl.program_id(2)
    bb = bh // H
    hh = bh % H
    offs, r, valid, b, i, last, b_last = _gates(B_LOG, I, bh, c, N, CHUNK, BLOCK_L)
    D, carried, intra, m_row = _stabilise(r, valid, b, i, tl.load(STATE_M + bh * (NC + 1) + c))
    offs_k = tl.arange(0, BLOCK_DQK)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    q = _load_tile(Q + bb * sqb + hh * sqh, offs, offs_k, sqn, sqd, N, DQK) * scale
    k = _load_tile(K + bb * skb + hh * skh, offs, offs_k, skn, skd, N, DQK)
    v = _load_tile(V + bb * svb + hh * svh, offs, offs_v, svn, svd, N, DV)
    st = bh * (NC + 1) + c
    C = _load_tile(STATE_C + st * DQK * DV, offs_k, offs_v, DV, 1, DQK, DV)
    n = tl.load(STATE_N + st * DQK + offs_k, mask=offs_k < DQK, other=0.0)
    carry = tl.where(valid, tl.exp(carried - m_row), 0.0)
    S = tl.dot(q, tl.trans(k), input_precision=PRECISION) * tl.exp(D - m_row[:, None])
    num = tl.dot(S, v, input_precision=PRECISION) + carry[:, None] * tl.dot(q, C, input_precision=PRECISION)
    qn = tl.sum(S, 1) + carry * tl.sum(q * n[None, :], 1)
    h = num / (tl.maximum(tl.abs(qn), tl.exp(-m_row)) + eps)[:, None]
    tl.store(H_OUT + (bh * N + offs[:, None]) * DV + offs_v[None, :], h, mask=valid[:, None] & (offs_v[None, :] < DV))
    rows_first = offs < tl.where(pid_v == 0, tl.minimum(N, (c + 1) * CHUNK), 0)  # valid rows, first tile
    tl.store(QN + bh * N + offs, qn, mask=rows_first)
    tl.store(M_ROW + bh * N + offs, m_row, mask=rows_first)


@triton.jit
def _carried_share(valid, carried, intra):
    """Share of a row's stabiliser gradient that goes to the carried state (torch.maximum's split)."""
    return tl.where(valid & (carried >= intra), tl.where(carried == intra, 0.5, 1.0), 0.0)


@triton.autotune(configs=_configs([(64, 4, 1), (128, 8, 1)]), key=_TUNE_KEY)
@triton.jit
def bwd_state_kernel(
    Q,
    DH,
    B_LOG,
    I,
    STATE_M,
    DEN,
    DQN,
    G_ROW,
    DC_N,
    DN_N,
    DM_N,
    GRAD_C,
    GRAD_N,
    GRAD_M,
    sqb,
    sqh,
    sqn,
    sqd,
    sdb,
    sdh,
    sdn,
    sdd,
    H,
    N,
    DQK,
    DV,
    NC,
    scale,
    HAS_DSTATE: tl.constexpr,
    PRECISION: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Gradients w.r.t. every chunk-start state (C, n scaled, at fixed stabilisers; index c) and the
    total gradient reaching each chunk-start stabiliser m_c (through the row maxima that the
    carried state won); index NC holds the incoming gradients of the final state."""
    bh = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1)
    bb = bh // H
    hh = bh % H
    offs_k = tl.arange(0, BLOCK_DQK)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    kv = offs_k[:, None] * DV + offs_v[None, :]
    kv_ok = (offs_k[:, None] < DQK) & (offs_v[None, :] < DV)
    first = pid_v == 0
    n_ok = offs_k < tl.where(first, DQK, 0)
    if HAS_DSTATE:
        G = tl.load(DC_N + bh * DQK * DV + kv, mask=kv_ok, other=0.0)
        Gn = tl.load(DN_N + bh * DQK + offs_k, mask=offs_k < DQK, other=0.0)
    else:
        G = tl.zeros([BLOCK_DQK, BLOCK_DV], tl.float32)
        Gn = tl.zeros([BLOCK_DQK], tl.float32)
    dm = tl.load(DM_N + bh)
    st = bh * (NC + 1) + NC
    tl.store(GRAD_C + st * DQK * DV + kv, G, mask=kv_ok)
    tl.store(GRAD_N + st * DQK + offs_k, Gn, mask=n_ok)
    if first:  # a scalar store takes no mask under the interpreter
        tl.store(GRAD_M + st, dm)
    for back in range(0, NC):
        c = NC - 1 - back
        m_c = tl.load(STATE_M + bh * (NC + 1) + c)
        offs, r, valid, b, i, last, b_last = _gates(B_LOG, I, bh, c, N, CHUNK, BLOCK_L)
        D, carried, intra, m_row = _stabilise(r, valid, b, i, m_c)
        g = tl.load(G_ROW + bh * N + offs, mask=valid, other=0.0) + tl.where(r == last, dm, 0.0)
        dm = tl.sum(_carried_share(valid, carried, intra) * g, 0)
        carry = tl.where(valid, tl.exp(carried - m_row), 0.0)
        q = _load_tile(Q + bb * sqb + hh * sqh, offs, offs_k, sqn, sqd, N, DQK) * (scale * carry)[:, None]
        den = tl.load(DEN + bh * N + offs, mask=valid, other=1.0)
        dnum = _load_tile(DH + bb * sdb + hh * sdh, offs, offs_v, sdn, sdd, N, DV) / den[:, None]
        dqn = tl.load(DQN + bh * N + offs, mask=valid, other=0.0)
        decay = tl.exp(b_last + m_c - tl.load(STATE_M + bh * (NC + 1) + c + 1))
        G = decay * G + tl.dot(tl.trans(q), dnum, input_precision=PRECISION)
        Gn = decay * Gn + tl.sum(q * dqn[:, None], 0)
        st = bh * (NC + 1) + c
        tl.store(GRAD_C + st * DQK * DV + kv, G, mask=kv_ok)
        tl.store(GRAD_N + st * DQK + offs_k, Gn, mask=n_ok)
        if first:  # a scalar store takes no mask under the interpreter
            tl.store(GRAD_M + st, dm)


# Register pressure: at d_qk 128 / chunk 64 this kernel keeps ~4 fp32 64×128 and ~6 fp32 64×64 tiles
# live, ~450 registers a thread at 4 warps (spills); 8 warps halve that.
@triton.autotune(configs=_configs([(32, 8, 1), (64, 8, 1)]), key=_TUNE_KEY)
@triton.jit
def bwd_chunk_kernel(
    Q,
    K,
    V,
    DH,
    B_LOG,
    I,
    STATE_C,
    STATE_N,
    STATE_M,
    GRAD_C,
    GRAD_N,
    GRAD_M,
    DEN,
    DQN,
    G_ROW,
    DQ,
    DK,
    DV_OUT,
    DI,
    DB,
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
    H,
    N,
    DQK,
    DV,
    NC,
    scale,
    PRECISION: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dq, dk, dv, di and db (b: the chunk-local cumulative log forget gate) of one chunk's steps.

    Terms: the intra-chunk scores (dS, and dD = dS⊙S on the log weights), the carried state's readout
    (through C_c, n_c and the carry weight), the keys' and the decay's contributions to the next
    state (through its gradient), and the stabilisers' gradients routed to their argmax.
    """
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    bb = bh // H
    hh = bh % H
    m_c = tl.load(STATE_M + bh * (NC + 1) + c)
    offs, r, valid, b, i, last, b_last = _gates(B_LOG, I, bh, c, N, CHUNK, BLOCK_L)
    D, carried, intra, m_row = _stabilise(r, valid, b, i, m_c)
    m_next = tl.load(STATE_M + bh * (NC + 1) + c + 1)
    offs_k = tl.arange(0, BLOCK_DQK)
    k_ok = offs_k < DQK
    q = _load_tile(Q + bb * sqb + hh * sqh, offs, offs_k, sqn, sqd, N, DQK) * scale
    k = _load_tile(K + bb * skb + hh * skh, offs, offs_k, skn, skd, N, DQK)
    P = tl.exp(D - m_row[:, None])
    QK = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    S = QK * P
    carry = tl.where(valid, tl.exp(carried - m_row), 0.0)
    key_w = tl.where(valid, tl.exp((b_last - b) + i - m_next), 0.0)  # each key's weight in the next state
    decay = tl.exp(b_last + m_c - m_next)
    den = tl.load(DEN + bh * N + offs, mask=valid, other=1.0)
    dqn = tl.load(DQN + bh * N + offs, mask=valid, other=0.0)
    st = bh * (NC + 1) + c
    n_c = tl.load(STATE_N + st * DQK + offs_k, mask=k_ok, other=0.0)
    gn_next = tl.load(GRAD_N + (st + 1) * DQK + offs_k, mask=k_ok, other=0.0)

    # Sums over d_v: dS = dnum·vᵀ, dnum·C_cᵀ (the readout's dq̃), dnum·(q̃C_c) (its carry weight's
    # gradient), v·G_{c+1}ᵀ (the next state's dk) and ΣG_{c+1}⊙C_c (its decay's gradient).
    dS = tl.zeros([BLOCK_L, BLOCK_L], tl.float32)
    dq_state = tl.zeros([BLOCK_L, BLOCK_DQK], tl.float32)
    dk_state = tl.zeros([BLOCK_L, BLOCK_DQK], tl.float32)
    dcarry = tl.zeros([BLOCK_L], tl.float32)
    d_decay = tl.sum(gn_next * n_c, 0)
    for v_start in range(0, DV, BLOCK_DV):
        offs_v = v_start + tl.arange(0, BLOCK_DV)
        v = _load_tile(V + bb * svb + hh * svh, offs, offs_v, svn, svd, N, DV)
        dnum = _load_tile(DH + bb * sdb + hh * sdh, offs, offs_v, sdn, sdd, N, DV) / den[:, None]
        C = _load_tile(STATE_C + st * DQK * DV, offs_k, offs_v, DV, 1, DQK, DV)
        G = _load_tile(GRAD_C + (st + 1) * DQK * DV, offs_k, offs_v, DV, 1, DQK, DV)
        dS += tl.dot(dnum, tl.trans(v), input_precision=PRECISION)
        dq_state += tl.dot(dnum, tl.trans(C), input_precision=PRECISION)
        dcarry += tl.sum(dnum * tl.dot(q, C, input_precision=PRECISION), 1)
        dk_state += tl.dot(v, tl.trans(G), input_precision=PRECISION)
        d_decay += tl.sum(tl.sum(G * C, 1), 0)
    dcarry += dqn * tl.sum(q * n_c[None, :], 1)
    dq_state += dqn[:, None] * n_c[None, :]
    dk_state += gn_next[None, :]

    dQK = (dS + dqn[:, None]) * P
    # Stabiliser gradients: every row's own (G_ROW) plus, on the chunk's last row, what reached m_{c+1};
    # the carried state's share went to m_c in bwd_state_kernel, the rest is split over the tied maxima.
    g = tl.load(G_ROW + bh * N + offs, mask=valid, other=0.0)
    g += tl.where(r == last, tl.load(GRAD_M + st + 1), 0.0)
    share = _carried_share(valid, carried, intra)
    tie = (D == m_row[:, None]) & valid[:, None]
    ties = tl.maximum(tl.sum(tie.to(tl.float32), 1), 1.0)
    dD = dQK * QK + tl.where(tie, ((1.0 - share) * g / ties)[:, None], 0.0)
    dE = key_w * tl.sum(k * dk_state, 1)  # gradient of each key's log weight into the next state
    col = tl.sum(dD, 0) + dE
    db = tl.sum(dD, 1) - col + share * g + dcarry * carry
    db += tl.where(r == last, tl.sum(dE, 0) + decay * d_decay, 0.0)
    dq = tl.dot(dQK, k, input_precision=PRECISION) + carry[:, None] * dq_state
    dk = tl.dot(tl.trans(dQK), q, input_precision=PRECISION) + key_w[:, None] * dk_state
    out = (bh * N + offs[:, None]) * DQK + offs_k[None, :]
    row_ok = valid[:, None] & k_ok[None, :]
    tl.store(DQ + out, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok)
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=row_ok)
    tl.store(DI + bh * N + offs, col, mask=valid)
    tl.store(DB + bh * N + offs, db, mask=valid)
    for v_start in range(0, DV, BLOCK_DV):
        offs_v = v_start + tl.arange(0, BLOCK_DV)
        dnum = _load_tile(DH + bb * sdb + hh * sdh, offs, offs_v, sdn, sdd, N, DV) / den[:, None]
        G = _load_tile(GRAD_C + (st + 1) * DQK * DV, offs_k, offs_v, DV, 1, DQK, DV)
        dv = tl.dot(tl.trans(S), dnum, input_precision=PRECISION) + key_w[:, None] * tl.dot(
            k, G, input_precision=PRECISION
        )
        tl.store(
            DV_OUT + (bh * N + offs[:, None]) * DV + offs_v[None, :],
            dv.to(DV_OUT.dtype.element_ty),
            mask=valid[:, None] & (offs_v[None, :] < DV),
        )


def buffer(*shape, device, dtype=torch.float32) -> Tensor:
    """An uninitialised buffer that a kernel fills completely (tests poison it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def _chunk_cumsum(x: Tensor, chunk: int, reverse: bool = False) -> Tensor:
    """Cumulative sum of x (B, H, N) within chunks of `chunk` steps (from the chunk's end if reverse)."""
    B, H, N = x.shape
    pad = -N % chunk
    x = F.pad(x, (0, pad)).view(B, H, -1, chunk)
    x = x.flip(-1).cumsum(-1).flip(-1) if reverse else x.cumsum(-1)
    return x.view(B, H, -1)[..., :N].contiguous()


def _meta(q: Tensor, v: Tensor, chunk: int) -> dict:
    B, H, N, DQK = q.shape
    return dict(
        H=H,
        N=N,
        DQK=DQK,
        DV=v.shape[-1],
        NC=triton.cdiv(N, chunk),
        CHUNK=chunk,
        BLOCK_L=max(16, triton.next_power_of_2(chunk)),
        BLOCK_DQK=max(16, triton.next_power_of_2(DQK)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fp32 inputs: no TF32 rounding


def forward(q, k, v, b, i, C0, n0, m0, eps: float, chunk: int):
    """h (B, H, N, d_v) fp32, the chunk-start states (B, H, NC+1, ·) fp32 (the last one is the final
    state), and each row's q̃·n and m (B, H, N) fp32. b, i (B, H, N) fp32 contiguous; C0, n0 fp32
    contiguous or None (empty state); m0 (B, H) fp32 contiguous (-inf for the empty state)."""
    B, H, N, DQK = q.shape
    meta = _meta(q, v, chunk)
    NC, DV, dev = meta["NC"], meta["DV"], q.device
    state_c, state_n = buffer(B, H, NC + 1, DQK, DV, device=dev), buffer(B, H, NC + 1, DQK, device=dev)
    state_m = buffer(B, H, NC + 1, device=dev)
    state_m[:, :, 0] = m0
    strides = (*q.stride(), *k.stride(), *v.stride())
    fwd_state_kernel[lambda a: (B * H, triton.cdiv(DV, a["BLOCK_DV"]))](
        k,
        v,
        b,
        i,
        C0 if C0 is not None else m0,
        n0 if n0 is not None else m0,
        state_c,
        state_n,
        state_m,
        *strides[4:],
        HAS_STATE=C0 is not None,
        **meta,
    )
    h, qn, m_row = buffer(B, H, N, DV, device=dev), buffer(B, H, N, device=dev), buffer(B, H, N, device=dev)
    fwd_chunk_kernel[lambda a: (NC, B * H, triton.cdiv(DV, a["BLOCK_DV"]))](
        q, k, v, b, i, state_c, state_n, state_m, h, qn, m_row, *strides, scale=DQK**-0.5, eps=eps, **meta
    )
    return h, (state_c, state_n, state_m), qn, m_row


def backward(q, k, v, b, i, states, den, dqn, g_row, dh, dC, dn, dm_final, chunk: int):
    """dq, dk, dv (inputs' dtypes), di, db (B, H, N) fp32 and the gradients of the initial state
    (C, n scaled at fixed m; the gradient reaching m through the maxima), given the host's row terms
    den, dqn (gradient of q̃·n) and g_row (gradient of each row's stabiliser), and the incoming
    gradients dh and of the final state (dC, dn: None or fp32 contiguous; dm_final (B, H) fp32)."""
    B, H, N, DQK = q.shape
    meta = _meta(q, v, chunk)
    NC, DV, dev = meta["NC"], meta["DV"], q.device
    state_c, state_n, state_m = states
    grad_c, grad_n = buffer(B, H, NC + 1, DQK, DV, device=dev), buffer(B, H, NC + 1, DQK, device=dev)
    grad_m = buffer(B, H, NC + 1, device=dev)
    scale = DQK**-0.5
    bwd_state_kernel[lambda a: (B * H, triton.cdiv(DV, a["BLOCK_DV"]))](
        q,
        dh,
        b,
        i,
        state_m,
        den,
        dqn,
        g_row,
        dC if dC is not None else den,
        dn if dn is not None else den,
        dm_final,
        grad_c,
        grad_n,
        grad_m,
        *q.stride(),
        *dh.stride(),
        scale=scale,
        HAS_DSTATE=dC is not None,
        **meta,
    )
    dq, dk, dv = (buffer(*t.shape, device=dev, dtype=t.dtype) for t in (q, k, v))
    di, db = buffer(B, H, N, device=dev), buffer(B, H, N, device=dev)
    bwd_chunk_kernel[(NC, B * H)](
        q,
        k,
        v,
        dh,
        b,
        i,
        state_c,
        state_n,
        state_m,
        grad_c,
        grad_n,
        grad_m,
        den,
        dqn,
        g_row,
        dq,
        dk,
        dv,
        di,
        db,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dh.stride(),
        scale=scale,
        **meta,
    )
    return dq, dk, dv, di, db, (grad_c[:, :, 0], grad_n[:, :, 0], grad_m[:, :, 0])


class _MLstmChunkwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, i, f, C0, n0, m0, eps, chunk):
        ctx.set_materialize_grads(False)  # the final state's gradient is usually absent
        B, H, N, _ = q.shape
        i32, f32 = i.detach().float().contiguous(), f.detach().float()
        b = _chunk_cumsum(F.logsigmoid(f32), chunk)
        has_state = C0 is not None
        C0_, n0_ = (C0.detach().float().contiguous(), n0.detach().float().contiguous()) if has_state else (None, None)
        m0_ = (m0.detach().float() if has_state else torch.full((B, H), -math.inf, device=q.device)).contiguous()
        h, states, qn, m_row = forward(q, k, v, b, i32, C0_, n0_, m0_, eps, chunk)
        ctx.save_for_backward(q, k, v, i32, f32, b, h, qn, m_row, *states, *((C0_, n0_) if has_state else ()))
        ctx.cfg = (eps, chunk, has_state)
        ctx.dtypes = [t.dtype for t in (q, k, v, i, f)] + [None if t is None else t.dtype for t in (C0, n0, m0)]
        final = tuple(s[:, :, -1].clone() for s in states)
        return h.to(q.dtype), *final

    @staticmethod
    @once_differentiable
    def backward(ctx, dh, dC, dn, dm):
        eps, chunk, has_state = ctx.cfg
        q, k, v, i, f, b, h, qn, m_row, state_c, state_n, state_m, *init = ctx.saved_tensors
        if dh is None:
            dh = torch.zeros_like(h)
        # The denominator den = max(|q̃·n|, exp(-m)) + eps: its gradient dden = -(dh·h)/den goes to q̃·n
        # where |q̃·n| wins (torch.maximum splits ties) and, scaled by eps, to the row's stabiliser.
        e = torch.exp(-m_row)
        den = torch.maximum(qn.abs(), e) + eps
        dden = -(dh.float() * h).sum(-1) / den
        wins = torch.where(qn.abs() > e, 1.0, torch.where(qn.abs() == e, 0.5, 0.0))
        dqn = (dden * torch.sign(qn) * wins).contiguous()
        g_row = (eps * dden).contiguous()
        # The final state is returned scaled by exp(-m_N): its explicit dependence on m_N.
        dm_final = torch.zeros_like(state_m[:, :, -1]) if dm is None else dm.float().clone()
        if dC is not None:
            dm_final -= (dC.float() * state_c[:, :, -1]).sum((-1, -2))
        if dn is not None:
            dm_final -= (dn.float() * state_n[:, :, -1]).sum(-1)
        if dC is not None or dn is not None:  # the kernel takes both or neither
            dC = (torch.zeros_like(state_c[:, :, -1]) if dC is None else dC.float()).contiguous()
            dn = (torch.zeros_like(state_n[:, :, -1]) if dn is None else dn.float()).contiguous()
        dq, dk, dv, di, db, (gC0, gn0, gm0) = backward(
            q, k, v, b, i, (state_c, state_n, state_m), den, dqn, g_row, dh, dC, dn, dm_final.contiguous(), chunk
        )
        df = _chunk_cumsum(db, chunk, reverse=True) * torch.sigmoid(-f)
        grads = [dq, dk, dv, di, df, None, None, None]
        if has_state:
            C0, n0 = init
            # C0, n0 enter as exp(m0)·C0, exp(m0)·n0: their share of m0's gradient (0 for m0 = -inf,
            # where the state gradients are exactly 0).
            gm0 = gm0 + (gC0 * C0).sum((-1, -2)) + (gn0 * n0).sum(-1)
            grads[5:] = [gC0, gn0, gm0]
        inputs = ctx.needs_input_grad
        return (
            *(
                g.to(dtype) if g is not None and inputs[n] else None
                for n, (g, dtype) in enumerate(zip(grads, ctx.dtypes))
            ),
            None,
            None,
        )


def mlstm_chunkwise_triton(
    q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, eps: float, chunk_size: int, state: MLstmState | None = None
) -> tuple[Tensor, MLstmState]:
    """kernels.mlstm.mlstm_chunkwise as Triton kernels (same arguments and result).

    q, k (B, H, N, d_qk) and v (B, H, N, d_v): fp32, fp16 or bf16 of one dtype, any strides; gates
    i, f (B, H, N) and the state are taken as fp32. h is returned in q's dtype, the final state in
    fp32; gradients reach every input that requires one, the initial state's included.
    """
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"the Triton mLSTM kernel takes fp32, fp16 or bf16 q, k, v of one dtype, got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    C0, n0, m0 = state if state is not None else (None, None, None)
    h, C, n, m = _MLstmChunkwise.apply(q, k, v, i, f, C0, n0, m0, eps, chunk_size)
    return h, MLstmState(C, n, m)
