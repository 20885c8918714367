"""bam_attention on torch's own attention kernels, for the calls on CUDA tensors that need no prior
gradient (kernels/dispatch.py; docs/design.md, "The dispatch rule"):

- `bam_attention_sdpa_causal`: full causal attention without a prior, window or documents (RoPE, NoPE,
  sinusoidal), with or without SSMax: one call of scaled_dot_product_attention with is_causal, for
  which torch picks its flash, cuDNN or memory-efficient kernel;
- `bam_attention_flex`: a window, documents or a fixed prior (ALiBi's slopes; any prior under
  no_grad), with or without SSMax: FlexAttention with a mask_mod reading key_start's first keys and
  a score_mod adding the prior from a per-head table over the offsets i - j, which prior_terms fills
  once per call.

SSMax multiplies row i's logits by c_i = s·ln n_i, which is scaling query i by c_i: q·c goes in, and
autograd takes s's gradient through it. Where SSMax scales the prior too (the default order), the
score_mod multiplies the prior by c_i, and s must be fixed there (its gradient would be a captured
tensor's; such calls stay on the Triton kernel, as `flex_applies` says).

Both take q, k, v in their own dtype, unlike the other forms of the op (torch's fused kernels take
bf16 as it is and accumulate in fp32; flash and cuDNN take nothing wider), and return q's dtype.
FlexAttention is compiled on CUDA tensors, where unfused it would materialise the N x N scores; it
runs eagerly elsewhere (the CPU tests, forward only: torch has no CPU backward for it).
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from megabam.kernels.bam_attention import AttentionOptions, bam_params, key_start, prior_scaled, prior_terms
from megabam.kernels.precision import compute_dtype


def sdpa_causal_applies(options: AttentionOptions) -> bool:
    """Whether bam_attention_sdpa_causal computes a call with these options."""
    return options.theta_alpha is None and options.window is None and options.doc_ids is None


def flex_applies(options: AttentionOptions) -> bool:
    """Whether bam_attention_flex computes a call with these options: any mask, and a prior needing no
    gradient, not scaled by a learnable SSMax."""
    scaled = options.theta_alpha is not None and options.ssmax_s is not None and not options.ssmax_before_prior
    return not options.prior_learnable and not (scaled and options.ssmax_learnable)


def bam_attention_sdpa_causal(
    q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions = AttentionOptions()
) -> Tensor:
    """megabam.kernels.bam_attention.bam_attention (same arguments, SSMax, grouped-query heads and
    result, computed in q's dtype) for the calls `sdpa_causal_applies` accepts."""
    options.check(q, k, v)
    if not sdpa_causal_applies(options):
        raise ValueError("bam_attention_sdpa_causal computes no prior, window or documents; use bam_attention")
    N, D = q.shape[-2:]
    c = ssmax_factor(options, key_start(None, None, N, q.device), q)
    return F.scaled_dot_product_attention(
        fold(q, c), k, v, is_causal=True, scale=options.head_scale(D), enable_gqa=k.shape[1] != q.shape[1]
    )


def sdpa_backend(q: Tensor, k: Tensor, options: AttentionOptions) -> str:
    """The kernel torch picks for bam_attention_sdpa_causal's call ("flash_attention", "cudnn_attention",
    "efficient_attention", "math"): torch's own choice function, which the call runs."""
    choice = torch._fused_sdp_choice(
        q, k, k, is_causal=True, scale=options.head_scale(q.shape[-1]), enable_gqa=k.shape[1] != q.shape[1]
    )
    return SDPBackend(choice).name.lower()


def bam_attention_flex(q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions = AttentionOptions()) -> Tensor:
    """megabam.kernels.bam_attention.bam_attention (same arguments, masks, prior, SSMax, grouped-query
    heads and result, computed in q's dtype; the prior's table in the compute dtype) for the calls
    `flex_applies` accepts."""
    options.check(q, k, v)
    if not flex_applies(options):
        raise ValueError(
            "bam_attention_flex computes no prior gradient and no prior scaled by a learnable SSMax; use bam_attention"
        )
    N, D = q.shape[-2:]
    lo = key_start(options.doc_ids, options.window, N, q.device)
    if options.doc_ids is None:
        block_mask = causal_block_mask(N, options.window, q.device)
    else:  # it follows the batch's documents: built per call
        block_mask = build_block_mask(lo)
    c = ssmax_factor(options, lo, q)
    score_mod = None if options.theta_alpha is None else prior_mod(options, c, N, compute_dtype(q), D)
    flex = compiled_flex() if q.is_cuda else flex_attention
    return flex(
        fold(q, c),
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=options.head_scale(D),
        enable_gqa=k.shape[1] != q.shape[1],
    )


def ssmax_factor(options: AttentionOptions, lo: Tensor, q: Tensor) -> Tensor | None:
    """SSMax's c = s·ln n_i (B, H, N) in the compute dtype, n_i = i - lo_i + 1 the keys row i sees
    (key_start), s as given (a gradient reaches it through q·c); None without SSMax."""
    if options.ssmax_s is None:
        return None
    B, _, N, _ = q.shape
    dtype = compute_dtype(q)
    log_n = torch.log((torch.arange(N, device=q.device) - lo.expand(B, N) + 1).to(dtype))
    return options.ssmax_s.to(dtype)[:, None] * log_n[:, None]


def fold(q: Tensor, c: Tensor | None) -> Tensor:
    """q with row i scaled by SSMax's c_i, in q's dtype (q itself without SSMax)."""
    return q if c is None else (q * c[..., None]).to(q.dtype)


def prior_mod(options: AttentionOptions, c: Tensor | None, n: int, dtype: torch.dtype, head_dim: int):
    """The score_mod adding the (fixed) prior to q·k·scale (times c_i when SSMax scales it, c then
    fixed too): read from its table over the offsets i - j = 0..n-1, (H, n), which prior_terms fills
    once per call."""
    p = bam_params(dtype, options.head_tensors, options.ssmax_before_prior, options.head_scale(head_dim))
    table = prior_terms(p, -torch.arange(n, device=p.alpha.device))[0]
    # The mods are evaluated at masked positions too (j > i), then overwritten: the offset is
    # clamped so those reads stay inside the table.
    if not prior_scaled(p):

        def score_mod(score, b, h, i, j):
            return score + table[h, (i - j).clamp(min=0)]

        return score_mod
    rows = c.detach()

    def scaled_mod(score, b, h, i, j):
        return score + table[h, (i - j).clamp(min=0)] * rows[b, h, i]

    return scaled_mod


def mask_mod_of(lo: Tensor):
    """The mask_mod of key_start's lo (B or 1, N): row i of batch row b sees keys lo[b, i]..i. A
    single row (no documents) serves every batch row, so it ignores b."""
    if lo.shape[0] == 1:
        first = lo[0]

        def mask_mod(b, h, i, j):
            return (j <= i) & (j >= first[i])

        return mask_mod

    def document_mask_mod(b, h, i, j):
        return (j <= i) & (j >= lo[b, i])

    return document_mask_mod


def build_block_mask(lo: Tensor) -> BlockMask:
    """FlexAttention's block mask of key_start's lo (B or 1, N), compiled on CUDA: eagerly
    create_block_mask fills a B x N x N boolean mask first."""
    B, N = lo.shape
    build = compiled_block_mask() if lo.is_cuda else create_block_mask
    return build(mask_mod_of(lo), None if B == 1 else B, None, N, N, device=lo.device)


@functools.lru_cache(maxsize=32)
def causal_block_mask(n: int, window: int | None, device: torch.device) -> BlockMask:
    """The block mask of one document of n tokens under this window, built on its first use: SWAX
    draws each step's window from a few, and the model's layers all share it."""
    return build_block_mask(key_start(None, window, n, device))


# Compiled on first use, so no process compiles what it never runs. The mods are new closures each
# call over new tensors, which dynamo guards by code and tensor shape, not identity: a new window,
# θ or batch of documents recompiles nothing (tested on CPU). Shapes are static: each new length or
# batch size compiles once, up to torch's recompile limit (8 by default); with torch's automatic
# dynamic shapes a batch-size change made inductor's CPU FlexAttention template fail to compile.
@functools.cache
def compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def compiled_block_mask():
    return torch.compile(create_block_mask, dynamic=False)
