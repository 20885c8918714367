"""kernels.bam_attention_sdpa (torch's fused attention: the CPU path of attention without a prior or
with a fixed one) against the dense float64 formula, and the cases it must refuse."""

import pytest
import torch
import torch.nn.functional as F
from helpers.attention_reference import dense_reference

import megabam.kernels.bam_attention_sdpa as sdpa
from megabam.kernels.bam_attention import AttentionOptions
from megabam.kernels.bam_attention_sdpa import applies, bam_attention_sdpa

B, H, N, D, BLOCK = 2, 4, 45, 8, 16  # N not a multiple of BLOCK on purpose
DOCS = torch.tensor([[0] * 10 + [1] * 28 + [2] * 7, [5] * 3 + [6] * 42])


def inputs(dtype, kv_heads=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, kv_heads, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    s = 0.5 + torch.rand(H, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v, s)]


def gradients(out, wrt, seed=1):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return out, *torch.autograd.grad(out, wrt, dout.to(out.dtype))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("ssmax", [False, True])
@pytest.mark.parametrize("window, doc", [(None, False), (1, False), (7, False), (7, True), (64, True)])
@pytest.mark.parametrize("kv_heads", [H, 2])
def test_matches_dense_reference(dtype, tol, ssmax, window, doc, kv_heads):
    q, k, v, s = inputs(dtype, kv_heads)
    doc_ids = DOCS if doc else None
    wrt = [q, k, v, s] if ssmax else [q, k, v]
    options = AttentionOptions(ssmax_s=s if ssmax else None, doc_ids=doc_ids, window=window, block_size=BLOCK)
    got = gradients(bam_attention_sdpa(q, k, v, options), wrt)
    ref_in = [t.detach().double().requires_grad_() for t in wrt]
    group = H // kv_heads  # the formula's heads: each key/value head copied for its query heads
    rk, rv = (t.repeat_interleave(group, dim=1) for t in ref_in[1:3])
    want = gradients(
        dense_reference(ref_in[0], rk, rv, s=ref_in[3] if ssmax else None, doc_ids=doc_ids, window=window), ref_in
    )
    assert got[0].dtype == dtype
    for name, a, b in zip(["out", "dq", "dk", "dv", "ds"], got, want):
        assert a.shape == b.shape, name
        err = (a.double() - b).abs().max().item()
        assert err <= tol * (1 + b.abs().max().item()), f"{name}: max err {err:.3g}"


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("ssmax", [False, True])  # True: SSMax before the prior (the prior is not scaled)
@pytest.mark.parametrize("window", [None, 1, 7])
@pytest.mark.parametrize("kv_heads", [H, 2])
def test_fixed_prior_matches_dense_reference(dtype, tol, ssmax, window, kv_heads):
    """A prior without gradient (ALiBi's slopes; θβ from inverted to super-Laplace, θμ ≠ 0) as the
    Toeplitz bias of each block's fused call."""
    q, k, v, s = inputs(dtype, kv_heads)
    theta = dict(
        theta_alpha=torch.linspace(-3, 0, H, dtype=dtype),
        theta_beta=torch.tensor([-0.7, 0.5, 1.0, 1.6], dtype=dtype),
        theta_mu=torch.linspace(-0.4, 0.4, H, dtype=dtype),
    )
    wrt = [q, k, v, s] if ssmax else [q, k, v]
    sm = dict(ssmax_s=s, ssmax_before_prior=True) if ssmax else {}
    got = gradients(bam_attention_sdpa(q, k, v, AttentionOptions(**theta, **sm, window=window, block_size=BLOCK)), wrt)
    ref_in = [t.detach().double().requires_grad_() for t in wrt]
    rk, rv = (t.repeat_interleave(H // kv_heads, dim=1) for t in ref_in[1:3])
    a, b, m = (t.double() for t in theta.values())
    ref = dense_reference(ref_in[0], rk, rv, a, b, m, s=ref_in[3] if ssmax else None, before_prior=ssmax, window=window)
    want = gradients(ref, ref_in)
    for name, x, y in zip(["out", "dq", "dk", "dv", "ds"], got, want):
        err = (x.double() - y).abs().max().item()
        assert err <= tol * (1 + y.abs().max().item()), f"{name}: max err {err:.3g}"


def test_low_precision_inputs_return_their_dtype():
    q, k, v, s = inputs(torch.float64)
    options = AttentionOptions(ssmax_s=s, window=5, block_size=BLOCK)
    ref = bam_attention_sdpa(q, k, v, options)
    out = bam_attention_sdpa(*(t.detach().bfloat16() for t in (q, k, v)), options)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref.detach(), atol=3e-2, rtol=3e-2)


def test_applies_where_no_prior_gradient_and_bounded_masks_are_needed():
    docs = torch.zeros(1, 8, dtype=torch.long)
    s = torch.ones(2, requires_grad=True)
    fixed = dict(theta_alpha=torch.zeros(2), theta_beta=torch.ones(2))
    learned = dict(theta_alpha=torch.zeros(2, requires_grad=True), theta_beta=torch.ones(2, requires_grad=True))

    def applies_to(**options):
        return applies(AttentionOptions(**options))

    assert applies_to() and applies_to(window=4) and applies_to(doc_ids=docs, window=4) and applies_to(ssmax_s=s)
    assert not applies_to(doc_ids=docs)  # masks up to block × N saved per block: the tiled op
    assert applies_to(**fixed) and applies_to(**fixed, window=4)
    assert applies_to(**fixed, ssmax_s=s, ssmax_before_prior=True)
    assert not applies_to(**learned)  # a learned prior needs its gradient: the tiled op
    assert not applies_to(**fixed, ssmax_s=s)  # c·prior is no longer a function of j - i
    assert not applies_to(**fixed, doc_ids=docs, window=4)  # nor is a document mask
    with torch.no_grad():  # inference needs no gradient of any prior
        assert applies_to(**learned)
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="computes no prior gradient"):
        bam_attention_sdpa(q, q, q, AttentionOptions(**learned))


def test_window_bounds_key_columns(monkeypatch):
    """With a window each query block's fused call sees at most block + window - 1 keys."""
    widths, real = [], F.scaled_dot_product_attention

    def counting(q, k, *args, **kwargs):
        widths.append(k.shape[-2])
        return real(q, k, *args, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", counting)
    n, w, blk = 200, 7, 16
    q = torch.randn(1, 2, n, 4, requires_grad=True)
    bam_attention_sdpa(q, q, q, AttentionOptions(window=w, block_size=blk)).sum().backward()
    assert len(widths) == -(-n // blk) and max(widths) <= blk + w - 1
