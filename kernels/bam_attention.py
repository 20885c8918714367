"""BAM attention (GGD positional prior + SSMax) in pure PyTorch, tiled over query blocks.

This is the op the CPU training path calls where a prior's gradient is needed (else torch's fused
attention, kernels/bam_attention_sdpa.py) and the reference a Triton kernel is tested against. It
never builds an N x N tensor: each query block only touches the keys its causal mask, window and
document can reach, and the backward recomputes each block's probabilities (a block holds whole rows,
so nothing per row needs saving), so memory is O(B·H·block·keys) per step and cost with a window is
O(N·w).
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from megabam.kernels.precision import compute_dtype

EPS = 1e-5  # keeps the diagonal prior finite when theta_beta < 0
# Cap on the prior's exponent (theta_alpha + theta_beta·ln(|d|+eps)). A log-prior of -e^60 already
# gives zero probability next to any sane logit; the cap keeps the prior, its product with the SSMax
# scale and all gradients finite in fp32 for any theta. Past the cap the prior's gradient is zero.
EXP_CAP = 60.0


class BamParams(NamedTuple):
    """The per-head tensors of one call, in the compute dtype, and its options."""

    alpha: Tensor | None  # (H,) theta_alpha; None = no prior
    beta: Tensor | None
    mu: Tensor | None  # raw theta_mu; None = mu 0
    s: Tensor | None  # (H,) SSMax scale; None = no SSMax
    ssmax_before_prior: bool
    scale: float
    key_cap: Tensor | None = None  # (H,) the most keys SSMax counts per head (AttentionOptions.ssmax_key_cap)


def bam_params(dtype, thetas, ssmax_before_prior: bool, scale: float, key_cap: Tensor | None = None) -> BamParams:
    """The (θα, θβ, θμ, s) tensors and the key cap, detached and cast to the compute dtype, with the options."""
    tensors = (None if t is None else t.detach().to(dtype) for t in (*thetas, key_cap))
    *heads, cap = tensors
    return BamParams(*heads, ssmax_before_prior, scale, cap)


def key_start(doc_ids: Tensor | None, window: int | None, n: int, device) -> Tensor:
    """lo[b, i]: first key query i may attend to, (B or 1, N) long; row i sees keys lo..i.

    This is the whole mask: causal (j <= i), window (i - window < j) and document (j >= start of i's
    document; documents are contiguous runs of equal doc_ids). lo is non-decreasing in i, and
    n_i = i - lo + 1 is the SSMax key count.
    """
    i = torch.arange(n, device=device)
    if doc_ids is None:
        lo = torch.zeros(1, n, dtype=torch.long, device=device)
    else:
        new_doc = torch.ones_like(doc_ids, dtype=torch.bool)
        new_doc[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        lo = torch.where(new_doc, i, 0).cummax(-1).values
    if window is not None:
        lo = torch.maximum(lo, i - window + 1)
    return lo


def query_blocks(lo: Tensor, n: int, block: int):
    """Yield (q_start, q_end, k_start): each query block and the first key any of its rows can see."""
    for qs in range(0, n, block):
        yield qs, min(qs + block, n), int(lo[:, qs].min())


def prior_terms(p: BamParams, delta: Tensor):
    """GGD log-prior -exp(θα)·(|d|+ε)^θβ at relative positions delta = j - i (1-D), as (H, L).

    d = delta - 2·sinh(θμ). Returns (prior, live, log_a, d): live marks entries under EXP_CAP (where
    the gradient flows) and log_a = ln(|d|+ε); the backward needs all of them. Computed in log space
    so exp(θα) and a^θβ cannot overflow on their own.
    """
    d = delta.to(p.alpha.dtype)[None]
    if p.mu is not None:
        d = d - 2 * torch.sinh(p.mu)[:, None]
    log_a = torch.log(d.abs() + EPS)
    expo = p.alpha[:, None] + p.beta[:, None] * log_a
    return -torch.exp(expo.clamp(max=EXP_CAP)), expo < EXP_CAP, log_a, d


class Tile(NamedTuple):
    """What block_logits computed besides the logits, for the backward: logits = (q·f)·kᵀ + bias."""

    qf: Tensor  # q·f, (B, H, R, D)
    f: Tensor | float  # the scale, times c = s·ln n_i (B or 1, H, R, 1) with SSMax
    log_n: Tensor | None  # ln n_i (B or 1, 1, R, 1), None without SSMax
    prior: tuple | None  # the prior_terms tuple over the tile's R + C - 1 offsets j - i


def query_factor(p: BamParams, log_n: Tensor | None) -> Tensor | float:
    """f in logits = (q·f)·kᵀ + bias: the scale, times SSMax's c = s·ln n_i (.., H, R, 1) when on.

    SSMax multiplies a whole row, (q·k·scale + prior)·c or q·k·scale·c + prior, so its q·k part is a
    per-row scale of the queries and costs R·D multiplications instead of R·C."""
    return p.scale if p.s is None else p.s[:, None, None] * log_n * p.scale


def add_prior(logits: Tensor, prior: Tensor, log_n: Tensor | None, p: BamParams) -> Tensor:
    """logits (.., H, R, C) += the prior's term, in place: prior·c when SSMax scales the prior too (the
    default), the prior alone without SSMax or with ssmax_before_prior; prior (H, R, C)."""
    if not prior_scaled(p):
        return logits.add_(prior)
    return logits.addcmul_(prior, p.s[:, None, None] * log_n)


def prior_scaled(p: BamParams) -> bool:
    """Whether SSMax's c = s·ln n_i multiplies the prior too (the default) rather than q·k alone."""
    return p.s is not None and not p.ssmax_before_prior


def offset_tables(p: BamParams, qs: int, R: int, ks: int, C: int, window: int | None, dtype, device):
    """The mask table (1, R + C - 1: 0 or -inf for causal and window) and the prior_terms tuple (None
    without a prior) of the tile of query rows qs.. against keys ks.. in reverse order, at the
    tile's R + C - 1 offsets j - i: entry (i, c) is key ks + C - 1 - c, at offset
    (ks + C - 1 - c) - (qs + i), table position i + c (toeplitz_tile)."""
    delta = (ks + C - 1 - qs) - torch.arange(R + C - 1, device=device)
    outside = (delta > 0) | ((delta <= -window) if window is not None else False)
    mask = torch.zeros(delta.shape, dtype=dtype, device=device).masked_fill_(outside, -math.inf)[None]
    return mask, None if p.alpha is None else prior_terms(p, delta)


def prior_weights(dprior: Tensor | float, prior: tuple, p: BamParams) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per offset, (dL/dθα, dL/dθβ, dL/dμ or None without θμ) of the prior_terms tuple `prior`, given
    dL/dprior `dprior` at each offset ((H, L), or 1.0: the prior's own derivatives, which the Triton
    kernel reads as tables)."""
    pr, live, log_a, d = prior
    g = torch.where(live, dprior * pr, 0)  # dL/d(exponent θα + θβ·log_a)
    dm = None
    if p.mu is not None:  # d|d|/dμ = -sign(d); d(a^β)/da = β·a^β/a
        dm = -(g * p.beta[:, None] * d.sign() / (d.abs() + EPS))
    return g, g * log_a, dm


def prior_grads(sums: Tensor, prior: tuple, p: BamParams) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """This tile's (dθα, dθβ, dθμ before its 2·cosh(θμ) factor or None, the prior's part of ds or
    None) per head, from `sums` (H, R + C - 1): dL/dlogits summed over the tile's entries at each
    offset, each weighted by ln n_i when the prior is scaled by c (prior_scaled)."""
    ds = None
    dpr = sums
    if prior_scaled(p):
        ds = (sums * prior[0]).sum(1)
        dpr = sums * p.s[:, None]
    da, db, dm = prior_weights(dpr, prior, p)
    return da.sum(1), db.sum(1), None if dm is None else dm.sum(1), ds


def key_count_log(lo: Tensor, rows: Tensor, dtype) -> Tensor:
    """ln n_i of the rows `rows` whose first keys are lo: n_i = i - lo + 1 keys, SSMax's count."""
    return torch.log((rows - lo + 1).to(dtype))


def capped_log(log_n: Tensor, key_cap: Tensor | None) -> Tensor:
    """ln n_i (.., 1, R, 1) at most ln of each head's key cap (H,), (.., H, R, 1) where some row
    reaches one (ssmax_key_cap; unchanged, shared by the heads, where none does). ln is monotonic, so
    min(ln n, ln cap) = ln min(n, cap)."""
    if key_cap is None:
        return log_n
    log_cap = key_cap.to(log_n.dtype).log()[:, None, None]
    return torch.minimum(log_n, log_cap) if bool((log_n > log_cap.min()).any()) else log_n


def toeplitz_tile(table: Tensor, R: int, C: int) -> Tensor:
    """tile[h, i, c] = table[h, i + c]: an (H, R, C) tile of a function of j - i given at its R + C - 1
    offsets, for keys in reverse order (column c is the block's key C - 1 - c): then j - i falls by
    one along both a row and a column, so the tile is a function of i + c, unfold's windows as they
    come (a strided view, no copy). In key order it would need a negative stride, and the copy that
    reverses it cost ~3x the tile's matmul; reversing k and v once per call costs N·D."""
    return table.unfold(1, C, 1)


def diagonal_sums(tile: Tensor) -> Tensor:
    """out[h, m] = Σ_i tile[h, i, m - i]: the sums of an (H, R, C) tile along each anti-diagonal
    i + c = m, the adjoint of toeplitz_tile. Padding each row with R - 1 zeros on both sides and
    reading the rows with one element less of stride shifts row i right by i, so the anti-diagonals
    line up as columns (one copy and a column sum; a scatter-add by index costs several times more)."""
    H, R, C = tile.shape
    padded = torch.nn.functional.pad(tile, (R - 1, R - 1))
    width = C + 2 * R - 2
    return padded.as_strided((H, R, R + C - 1), (R * width, width - 1, 1), padded.storage_offset() + R - 1).sum(1)


def block_logits(
    q: Tensor, k: Tensor, qs: int, ks: int, lo: Tensor, p: BamParams, window: int | None = None
) -> tuple[Tensor, Tile]:
    """Masked logits (B, H, R, C) of query rows qs.. against keys ks.. **in reverse key order**
    (column c is key ks + C - 1 - c: see toeplitz_tile), and the Tile the backward needs.

    q: (B, H, R, D) and k: (B, H, C, D) (its rows in that reverse order) in the compute dtype, lo:
    (B or 1, R) key starts of the rows, window: the call's window (lo holds it too; here it goes into
    the mask's offset table). Logits are (q·f)·kᵀ + the prior's term (query_factor, add_prior) + the
    mask (0 / -inf: masked entries are -inf, so exp() makes them exactly 0), added in place to the
    matmul's output: the logit tile is the op's largest tensor, and each pass over it costs about as
    much as the matmul itself at these head sizes.
    """
    R, C = q.shape[-2], k.shape[-2]
    rows = torch.arange(qs, qs + R, device=q.device)
    log_n = None if p.s is None else capped_log(key_count_log(lo, rows, q.dtype)[:, None, :, None], p.key_cap)
    f = query_factor(p, log_n)
    qf = q * f
    logits = torch.matmul(qf, k.transpose(-1, -2))
    # The causal and window masks depend on j - i only, like the prior, so they too are a table read
    # as a Toeplitz view (adding a view costs ~1/5 of building a boolean mask tile and filling it).
    mask, prior = offset_tables(p, qs, R, ks, C, window, q.dtype, q.device)
    if prior is not None:
        if prior_scaled(p):
            add_prior(logits, toeplitz_tile(prior[0], R, C), log_n, p)
        else:  # prior and mask in one table, one pass
            mask = mask + prior[0]
    logits.add_(toeplitz_tile(mask, R, C))
    # Documents: rows whose document starts after both the block's first key and their window's
    # first key need a per-row mask too; only blocks holding a document boundary have such rows.
    own = (rows - window + 1).clamp(min=ks) if window is not None else torch.full_like(rows, ks)
    if bool((lo > own).any()):
        cols = torch.arange(ks + C - 1, ks - 1, -1, device=q.device)
        logits.add_(torch.where(cols >= lo[:, :, None], 0.0, -math.inf).to(q.dtype)[:, None])
    return logits, Tile(qf, f, log_n, prior)


class _BAMAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alpha, beta, mu, s, lo, ssmax_before_prior, block, scale, window, key_cap):
        dtype = compute_dtype(q)
        p = bam_params(dtype, (alpha, beta, mu, s), ssmax_before_prior, scale, key_cap)
        # Keys and values in reverse order (block_logits): keys ks..qe-1 are rows N-qe..N-ks.
        qc, kc, vc = q.to(dtype), k.to(dtype).flip(2), v.to(dtype).flip(2)
        B, H, N, _ = q.shape
        out = torch.empty(B, H, N, v.shape[-1], dtype=dtype, device=q.device)
        for qs, qe, ks in query_blocks(lo, N, block):
            logits = block_logits(qc[:, :, qs:qe], kc[:, :, N - qe : N - ks], qs, ks, lo[:, qs:qe], p, window)[0]
            # The diagonal is always allowed, so no row is all -inf. Nothing per row is saved: a block
            # holds whole rows, and the backward recomputes the softmax as cheaply as exp(logits - lse).
            out[:, :, qs:qe] = torch.softmax(logits, -1) @ vc[:, :, N - qe : N - ks]
        # The reversed keys and values, not k and v: the backward needs them so, and flipping costs.
        ctx.save_for_backward(q, kc, vc, lo, alpha, beta, mu, s)
        ctx.cfg = (ssmax_before_prior, block, scale, window, k.dtype, v.dtype, key_cap)
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, kc, vc, lo, alpha, beta, mu, s = ctx.saved_tensors
        ssmax_before_prior, block, scale, window, k_dtype, v_dtype, key_cap = ctx.cfg
        dtype = compute_dtype(q)
        p = bam_params(dtype, (alpha, beta, mu, s), ssmax_before_prior, scale, key_cap)
        qc, do = q.to(dtype), dout.to(dtype)
        _, H, N, _ = q.shape
        dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
        da, db, dm, ds = (torch.zeros(H, dtype=dtype, device=q.device) for _ in range(4))
        for qs, qe, ks in query_blocks(lo, N, block):
            qb, kb, vb, dob = qc[:, :, qs:qe], kc[:, :, N - qe : N - ks], vc[:, :, N - qe : N - ks], do[:, :, qs:qe]
            logits, t = block_logits(qb, kb, qs, ks, lo[:, qs:qe], p, window)
            prob = torch.softmax(logits, -1)
            dv[:, :, N - qe : N - ks] += prob.transpose(-1, -2) @ dob
            # Softmax backward p⊙(dP - Σ_j p·dP) in one fused pass, with the row sum from the recomputed
            # p rather than rowsum(dO⊙O) (equal in exact arithmetic; a key-tiled kernel must use the
            # latter): consistent with p, a row with one allowed key gets exactly zero logit gradient
            # instead of rounding noise amplified by the prior's derivative. 0 on masked entries.
            dlogits = torch.ops.aten._softmax_backward_data(dob @ vb.transpose(-1, -2), prob, -1, dtype)
            dqf = dlogits @ kb  # d/d(q·f)
            dq[:, :, qs:qe] = dqf * t.f
            dk[:, :, N - qe : N - ks] += dlogits.transpose(-1, -2) @ t.qf
            if s is not None:
                # c = s·ln n multiplies q·k·scale (and the prior unless ssmax_before_prior), so
                # dL/ds = Σ ln n·(dlogits·q·k·scale [+ dlogits·prior]); the q·k part is the row dot
                # product of q with dlogits @ k (R·D, not R·C).
                ds += (t.log_n * (dqf * qb).sum(-1, keepdim=True)).sum((0, 2, 3)) * scale
            if t.prior is not None:
                # The prior tile is Toeplitz, so its gradient is wanted per offset: sums along each
                # anti-diagonal of dL/dtile (keys reversed; summed over the batch first).
                batch_sum = dlogits.sum(0) if dlogits.shape[0] > 1 else dlogits[0]
                per_n = batch_sum
                if prior_scaled(p):  # the prior is scaled by c = s·ln n too: weight each row by ln n
                    log_n = t.log_n[0] if t.log_n.shape[0] == 1 else None
                    per_n = batch_sum * log_n if log_n is not None else (dlogits * t.log_n).sum(0)
                for total, g in zip((da, db, dm, ds), prior_grads(diagonal_sums(per_n), t.prior, p)):
                    if g is not None:
                        total += g
        if mu is not None:
            dm = dm * 2 * torch.cosh(p.mu)

        dk, dv = dk.flip(2), dv.flip(2)
        dtypes = (q.dtype, k_dtype, v_dtype, *(None if t is None else t.dtype for t in (alpha, beta, mu, s)))
        return (
            *(
                g.to(t) if ctx.needs_input_grad[i] else None
                for i, (g, t) in enumerate(zip((dq, dk, dv, da, db, dm, ds), dtypes))
            ),
            None,
            None,
            None,
            None,
            None,
            None,
        )


@dataclass(frozen=True, eq=False)  # eq=False: == and hash by identity, never comparing tensors
class AttentionOptions:
    """What one call of BAM attention computes besides q, k, v: the one options argument of every form
    of the op (bam_attention, bam_attention_cpu, bam_attention_sdpa, bam_attention_sdpa_causal,
    bam_attention_flex, bam_attention_triton, dense_bam_attention, dense_bam_weights), which
    kernels/dispatch.py passes through. Its own rules are checked when it is made; `check` adds
    those on q, k, v.

    Masks: row i may attend to key j iff j <= i, i - window < j (`window` counts the token itself;
    None: no window) and doc_ids[b, j] == doc_ids[b, i] (`doc_ids` (B, N), documents being contiguous
    runs of equal ids; None: one document).

    Prior (theta_alpha, theta_beta given, (H,) each; theta_mu (H,) or None for μ = 0):
    prior_ij = -exp(θα)·(|j - i - μ| + 1e-5)^θβ with μ = 2·sinh(θμ); θβ is used raw (β < 0 allowed).
    SSMax (ssmax_s (H,) given): with n_i the number of keys row i may attend to, logits are
    (q·k·scale + prior)·s·ln n_i, or q·k·scale·s·ln n_i + prior if ssmax_before_prior.
    `ssmax_key_cap` ((H,), or None): the most keys SSMax counts in each head, n_i replaced by
    min(n_i, cap_h) (inf: no cap). The tiled op (bam_attention), the dense ones and the C and
    Triton kernels apply it; kernels/dispatch.py sends them every call long enough to reach a cap.
    θα, θβ, θμ and s are per query head; gradients flow to each one that requires grad. `scale`
    defaults to 1/sqrt(D). `block_size`: query rows per tile of the tiled ops, whose memory is
    O(block_size · keys); the fused kernels choose their own tiles.
    """

    theta_alpha: Tensor | None = None
    theta_beta: Tensor | None = None
    theta_mu: Tensor | None = None
    ssmax_s: Tensor | None = None
    ssmax_before_prior: bool = False
    doc_ids: Tensor | None = None
    window: int | None = None
    block_size: int = 128
    scale: float | None = None
    ssmax_key_cap: Tensor | None = None

    def __post_init__(self) -> None:
        if (self.theta_alpha is None) != (self.theta_beta is None):
            raise ValueError("theta_alpha and theta_beta must be given together")
        if self.theta_mu is not None and self.theta_alpha is None:
            raise ValueError("theta_mu needs theta_alpha and theta_beta")
        if self.ssmax_key_cap is not None and self.ssmax_s is None:
            raise ValueError("ssmax_key_cap caps SSMax's key count: it needs ssmax_s")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def check(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        """The rules on q, k, v every form of the op shares: k and v have one head count, dividing q's."""
        h, h_k, h_v = q.shape[1], k.shape[1], v.shape[1]
        if h_k != h_v:
            raise ValueError(f"k and v must have the same number of heads, got {h_k} and {h_v}")
        if h_k < 1 or h % h_k:
            raise ValueError(
                f"k and v have {h_k} heads, which does not divide q's {h} heads "
                f"(grouped-query attention needs H_kv to divide H)"
            )

    @property
    def head_tensors(self) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
        """(θα, θβ, θμ, s), in the order the ops' autograd functions take them."""
        return self.theta_alpha, self.theta_beta, self.theta_mu, self.ssmax_s

    @property
    def prior_learnable(self) -> bool:
        """Whether the call needs the prior's gradient: some θ requires grad, under grad mode."""
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in self.head_tensors[:3])

    @property
    def ssmax_learnable(self) -> bool:
        """Whether the call needs s's gradient: s requires grad, under grad mode."""
        return torch.is_grad_enabled() and self.ssmax_s is not None and self.ssmax_s.requires_grad

    def head_scale(self, head_dim: int) -> float:
        """The logits' scale: `scale`, or 1/sqrt(head_dim) by default."""
        return head_dim**-0.5 if self.scale is None else float(self.scale)


def bam_attention(q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions = AttentionOptions()) -> Tensor:
    """Causal attention with the BAM GGD log-prior and SSMax, tiled so no N x N tensor exists; the
    prior, SSMax and masks are those `options` (AttentionOptions) describe.

    q: (B, H, N, D), k, v: (B, H_kv, N, D) with H_kv dividing H, of any float dtype; computed in fp32
    (fp64 for fp64 inputs), returned in q's dtype. Grouped-query attention when H_kv < H: query head
    h reads key/value head h // (H // H_kv) (consecutive query heads share one, as in Llama and
    Megatron); θα, θβ, θμ and s stay per query head (H,). Gradients flow to q, k, v and to every θ /
    s that requires grad.
    """
    options.check(q, k, v)
    k, v, lo, scale = tiled_inputs(q, k, v, options)
    return _BAMAttention.apply(
        q,
        k,
        v,
        *options.head_tensors,
        lo,
        options.ssmax_before_prior,
        options.block_size,
        scale,
        options.window,
        options.ssmax_key_cap,
    )


def tiled_inputs(q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions):
    """(k, v with a copy per query head, lo, scale): what the tiled ops (this one and the C tiles')
    take from bam_attention's arguments."""
    N, D = q.shape[-2:]
    lo = key_start(options.doc_ids, options.window, N, q.device)
    scale = options.head_scale(D)
    if k.shape[1] != q.shape[1]:
        # Grouped-query attention, the obviously-correct way: give every query head its own copy of
        # its group's key/value head and run the per-head op. repeat_interleave's backward sums the
        # copies' gradients, so dk, dv come back with k's and v's shape, summed over each group's
        # query heads. Costs G = H / H_kv copies of k and v per call (the Triton kernel indexes the
        # shared head instead). H_kv == H never takes this branch.
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return k, v, lo, scale


def dense_bam_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    options: AttentionOptions = AttentionOptions(),
    in_order: bool = False,
) -> Tensor:
    """The op's attention (same prior, SSMax and masks, one document) of queries at stream positions
    q_pos (C,) to keys at k_pos (S,), for streaming inference against a KV cache. k_pos -1 marks an
    empty cache slot. q (B, H, C, D), k, v (B, H_kv, S, D); computed in the compute dtype, returned in
    q's dtype. No gradients of its own: inference only. `options` as for `dense_bam_weights`.

    `in_order`: the caller's promise that the keys are positions 0..S-1 and the queries the last C of
    them, without a window (a prompt read in chunks against a growing KV cache). Then the queries are
    computed block by block with the tiled op's `block_logits` (the prior a Toeplitz view, R + C - 1
    values per head) instead of as C × S dense logits."""
    options.check(q, k, v)
    group = q.shape[1] // k.shape[1]
    v = v.repeat_interleave(group, 1)
    if in_order:
        if options.window is not None:
            raise ValueError("in_order attention has no window (a window's keys are a ring, not in order)")
        return _in_order(q, k.repeat_interleave(group, 1), v, dense_params(q, k, options))
    probs = dense_bam_weights(q, k, q_pos, k_pos, options)
    return (probs @ v.to(probs.dtype)).to(q.dtype)


def _in_order(q: Tensor, k: Tensor, v: Tensor, p: BamParams, block: int = 128) -> Tensor:
    """dense_bam_attention of the last C of S in-order positions, block by block, each block against
    the keys up to its last row."""
    dtype = compute_dtype(q)
    qc, kc, vc = q.to(dtype), k.to(dtype).flip(2), v.to(dtype).flip(2)
    S = k.shape[2]
    q0 = S - q.shape[2]
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=dtype, device=q.device)
    lo = torch.zeros((1, block), dtype=torch.long, device=q.device)  # one document from position 0
    for r in range(0, q.shape[2], block):
        rows = min(block, q.shape[2] - r)
        keys = q0 + r + rows  # the keys up to this block's last row
        # Keys and values in reverse order (block_logits): keys 0..keys-1 are the last `keys` rows.
        logits = block_logits(qc[:, :, r : r + rows], kc[:, :, S - keys :], q0 + r, 0, lo[:, :rows], p)[0]
        out[:, :, r : r + rows] = torch.softmax(logits, -1) @ vc[:, :, S - keys :]
    return out.to(q.dtype)


def dense_params(q: Tensor, k: Tensor, options: AttentionOptions) -> BamParams:
    """The checked options of dense_bam_attention / dense_bam_weights as the op's parameters."""
    options.check(q, k, k)
    if options.doc_ids is not None:
        raise ValueError("dense attention computes one document (a stream): doc_ids must be None")
    return bam_params(
        compute_dtype(q),
        options.head_tensors,
        options.ssmax_before_prior,
        options.head_scale(q.shape[-1]),
        options.ssmax_key_cap,
    )


def dense_bam_weights(
    q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, options: AttentionOptions = AttentionOptions()
) -> Tensor:
    """The attention probabilities (B, H, C, S) of `dense_bam_attention`, in the compute dtype (also
    what `megabam plot attention` draws). `options`: the op's AttentionOptions, one document (no
    doc_ids); block_size is not read."""
    p = dense_params(q, k, options)
    window = options.window
    dtype = compute_dtype(q)
    group = q.shape[1] // k.shape[1]  # each key/value head serves `group` query heads
    qc, kc = q.to(dtype), k.to(dtype).repeat_interleave(group, 1)
    # A stream is one document from position 0, so a row's first key is set by the window alone.
    lo = q_pos.new_zeros(q_pos.shape) if window is None else (q_pos - window + 1).clamp(min=0)
    delta = k_pos[None, :] - q_pos[:, None]  # j - i, (C, S)
    allowed = (k_pos[None, :] >= lo[:, None]) & (delta <= 0)
    log_n = None if p.s is None else capped_log(key_count_log(lo, q_pos, dtype)[:, None], p.key_cap)
    logits = (qc * query_factor(p, log_n)) @ kc.transpose(-1, -2)
    if p.alpha is not None:
        add_prior(logits, prior_terms(p, delta.flatten())[0].view(-1, *delta.shape), log_n, p)
    return torch.softmax(logits.masked_fill(~allowed, -math.inf), dim=-1)
