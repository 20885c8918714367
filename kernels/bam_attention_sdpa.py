"""bam_attention on torch's fused attention (scaled_dot_product_attention), where it can compute it.

torch's CPU flash-attention kernel fuses what the tiled reference op does in separate passes over each
logit tile (scale, mask, softmax, and in the backward the softmax gradient), and like it never holds
an N x N tensor. It returns no gradient for an additive bias, so it serves:

- no prior (RoPE, NoPE, sinusoidal), with or without SSMax: without a prior SSMax is a per-row scale
  of the queries, c_i = s·ln n_i, whose gradient autograd takes;
- a prior that needs no gradient (ALiBi's fixed slopes; any prior under no_grad), without SSMax or
  with ssmax_before_prior (then the prior is not scaled by c), and without documents. Such a bias
  depends on j - i only, and so do the causal and window masks: a query block's bias tile is a
  Toeplitz matrix, read as a strided view (unfold) of its R + C - 1 values per head with the block's
  query rows in reverse order. The view is what the backward saves, so memory stays linear in N.

Masks: causal only, one call with is_causal; a window or a prior, one call per query block against
the keys it can reach (O(N·(block + window)) with a window), with a boolean mask (documents) or the
prior's tile. Documents without a window would need boolean masks up to block × N per block, saved
for the backward (quadratic in N): that case stays on the tiled op, as `applies` says.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from megabam.kernels.bam_attention import (
    AttentionOptions,
    bam_params,
    key_count_log,
    key_start,
    prior_terms,
    query_blocks,
)
from megabam.kernels.precision import compute_dtype


def applies(options: AttentionOptions) -> bool:
    """Whether bam_attention_sdpa computes a call with these options."""
    if options.theta_alpha is None:
        return options.doc_ids is None or options.window is not None
    fixed = not options.prior_learnable
    return fixed and options.doc_ids is None and (options.ssmax_s is None or options.ssmax_before_prior)


def bam_attention_sdpa(q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions = AttentionOptions()) -> Tensor:
    """megabam.kernels.bam_attention.bam_attention (same arguments, masks, SSMax, grouped-query heads,
    compute dtype and result) for the calls `applies` accepts."""
    options.check(q, k, v)
    if not applies(options):
        raise ValueError(
            "bam_attention_sdpa computes no prior gradient, no prior scaled by SSMax and no document mask "
            "beside a prior or without a window; use bam_attention"
        )
    N, D = q.shape[-2:]
    dtype = compute_dtype(q)
    qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = options.head_scale(D)
    gqa = k.shape[1] != q.shape[1]
    lo = key_start(options.doc_ids, options.window, N, q.device)
    if options.ssmax_s is not None:  # without a prior, or with the prior outside SSMax's scale
        log_n = key_count_log(lo, torch.arange(N, device=q.device), dtype)  # (B or 1, N)
        qc = qc * (options.ssmax_s.to(dtype)[:, None, None] * log_n[:, None, :, None])
    if options.theta_alpha is None and options.doc_ids is None and options.window is None:
        out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
        return out.to(q.dtype)
    thetas = (options.theta_alpha, options.theta_beta, options.theta_mu, None)
    p = None if options.theta_alpha is None else bam_params(dtype, thetas, False, scale)
    blocks = []
    for qs, qe, ks in query_blocks(lo, N, options.block_size):
        qb, kb, vb = qc[:, :, qs:qe], kc[:, :, ks:qe], vc[:, :, ks:qe]
        if p is None:
            rows = torch.arange(qs, qe, device=q.device)[:, None]
            cols = torch.arange(ks, qe, device=q.device)[None, :]
            allowed = (cols <= rows) & (cols >= lo[:, qs:qe, None])  # (B or 1, R, C)
            blocks.append(
                F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed[:, None], scale=scale, enable_gqa=gqa)
            )
            continue
        # The prior and the masks at the R + C - 1 offsets j - i of the block, from its last row's first
        # key on: row r of the reversed block (query qe - 1 - r) reads them from position r on.
        delta = torch.arange(ks - (qe - 1), qe - qs, device=q.device)
        outside = (delta > 0) | ((delta <= -options.window) if options.window is not None else False)
        table = prior_terms(p, delta)[0].masked_fill(outside, -math.inf)
        out = F.scaled_dot_product_attention(
            qb.flip(2), kb, vb, attn_mask=table.unfold(1, qe - ks, 1)[None], scale=scale, enable_gqa=gqa
        )
        blocks.append(out.flip(2))
    return torch.cat(blocks, dim=2).to(q.dtype)
