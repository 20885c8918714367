"""kernels.bam_attention_torch (torch's SDPA and FlexAttention: the CUDA path of attention without a
prior gradient) on CPU tensors, called directly: against the dense float64 formula, FlexAttention's
mask against key_start's, its block masks' cache, and the calls each op refuses.

FlexAttention runs eagerly here (compiled only on CUDA tensors). torch refuses its backward on CPU
(`_validate_device`), yet its eager form has one (the dense math its compiled kernels are tested
against), so the gradient test lifts that check to see q, k, v and SSMax's s get theirs through the
op.
"""

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from helpers.attention_reference import dense_reference
from torch.nn.attention.flex_attention import create_mask

import megabam.kernels.bam_attention_torch as torch_attention
from megabam.kernels.bam_attention import AttentionOptions, key_start
from megabam.kernels.bam_attention_torch import (
    bam_attention_flex,
    bam_attention_sdpa_causal,
    build_block_mask,
    causal_block_mask,
    flex_applies,
    mask_mod_of,
    sdpa_backend,
    sdpa_causal_applies,
)

B, H, N, D = 2, 4, 45, 16
DOCS = torch.tensor([[0] * 10 + [1] * 28 + [2] * 7, [5] * 3 + [6] * 42])
# ALiBi's family member (β = 1, fixed slopes) and a GGD prior from inverted to super-Laplace with μ ≠ 0
ALIBI = dict(theta_alpha=torch.tensor([-0.7, -1.4, -2.1, -2.8]), theta_beta=torch.ones(H))
GGD = dict(
    theta_alpha=torch.linspace(-3, 0, H),
    theta_beta=torch.tensor([-0.7, 0.5, 1.0, 1.6]),
    theta_mu=torch.linspace(-0.4, 0.4, H),
)


# Eager FlexAttention warns that it is not compiled: here that is the point.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def inputs(kv_heads=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, kv_heads, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    s = 0.5 + torch.rand(H, generator=g, dtype=torch.float64)
    return q, k, v, s


def reference(q, k, v, options: AttentionOptions):
    """dense_reference of a call, each key/value head copied for its query heads."""
    group = q.shape[1] // k.shape[1]
    rk, rv = (t.repeat_interleave(group, dim=1) for t in (k, v))
    alpha, beta, mu, s = options.head_tensors
    return dense_reference(
        q, rk, rv, alpha, beta, mu, s, options.ssmax_before_prior, doc_ids=options.doc_ids, window=options.window
    )


def gradients(out, wrt, seed=1):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return out, *torch.autograd.grad(out, wrt, dout)


def assert_close(got, want, names, tol=1e-10):
    for name, a, b in zip(names[: len(got)], got, want, strict=True):
        assert a.shape == b.shape, name
        err = (a - b).abs().max().item()
        assert err <= tol * (1 + b.abs().max().item()), f"{name}: max err {err:.3g}"


@pytest.mark.parametrize("ssmax", [False, True])
@pytest.mark.parametrize("kv_heads", [H, 2])
def test_sdpa_causal_matches_dense_reference_with_gradients(ssmax, kv_heads):
    """One fused call; SSMax's c_i = s·ln(i + 1) folded into q, so s gets its gradient through it."""
    q, k, v, s = (t.requires_grad_() for t in inputs(kv_heads))
    wrt = [q, k, v, s] if ssmax else [q, k, v]
    options = AttentionOptions(ssmax_s=s if ssmax else None)
    got = gradients(bam_attention_sdpa_causal(q, k, v, options), wrt)
    want = gradients(reference(q, k, v, options), wrt)
    assert_close(got, want, ["out", "dq", "dk", "dv", "ds"])


def test_sdpa_causal_keeps_low_precision_inputs_as_they_come():
    """bf16 goes to torch's kernel as it is (flash and cuDNN take nothing wider) and comes back bf16."""
    q, k, v, s = inputs()
    options = AttentionOptions(ssmax_s=s.float())
    got = bam_attention_sdpa_causal(q.bfloat16(), k.bfloat16(), v.bfloat16(), options)
    assert got.dtype == torch.bfloat16
    assert_close([got.double()], [reference(q, k, v, options)], ["out"], tol=3e-2)


PRIORS = {"none": {}, "alibi": ALIBI, "ggd": GGD}
SSMAX = {"none": {}, "before prior": dict(ssmax_before_prior=True), "scaling the prior": {}}


@pytest.mark.parametrize("prior", list(PRIORS))
@pytest.mark.parametrize("ssmax", list(SSMAX))
@pytest.mark.parametrize("window, doc", [(None, False), (1, False), (7, False), (None, True), (7, True)])
@pytest.mark.parametrize("kv_heads", [H, 2])
def test_flex_matches_dense_reference(prior, ssmax, window, doc, kv_heads):
    """Windows, documents, a fixed prior from its per-offset table, SSMax folded into q (and, scaling
    the prior, in the score_mod), grouped-query heads."""
    q, k, v, s = inputs(kv_heads)
    theta = {name: t.double() for name, t in PRIORS[prior].items()}
    sm = {} if ssmax == "none" else dict(ssmax_s=s, **SSMAX[ssmax])
    options = AttentionOptions(**theta, **sm, window=window, doc_ids=DOCS if doc else None)
    assert flex_applies(options)
    assert_close([bam_attention_flex(q, k, v, options)], [reference(q, k, v, options)], ["out"])


@pytest.mark.parametrize(
    "fields",
    [
        dict(ssmax_before_prior=True, window=7, **GGD),
        dict(doc_ids=DOCS, window=9),
        dict(doc_ids=DOCS, ssmax_before_prior=True, **ALIBI),
    ],
    ids=["ggd prior, ssmax before it, window", "documents and window", "alibi, ssmax before it, documents"],
)
def test_flex_gradients_reach_q_k_v_and_a_learnable_ssmax(monkeypatch, fields):
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)  # see the module docstring
    q, k, v, s = (t.requires_grad_() for t in inputs(2))
    theta = {name: t.double() if torch.is_tensor(t) and t.is_floating_point() else t for name, t in fields.items()}
    options = AttentionOptions(ssmax_s=s, **theta)
    assert flex_applies(options)  # s learnable: the prior is fixed and not scaled by it, or absent
    got = gradients(bam_attention_flex(q, k, v, options), [q, k, v, s])
    want = gradients(reference(q, k, v, options), [q, k, v, s])
    assert_close(got, want, ["out", "dq", "dk", "dv", "ds"])


LAYOUTS = {
    "one document": None,
    "three": torch.tensor([[0] * 9 + [1] * 30 + [2] * 25] * 2),
    "runs of one token, a repeated id": torch.tensor([[4, 5, 4, 4, 7] + [7] * 59, [1] * 63 + [2]]),
}


@pytest.mark.parametrize("n", [1, 17, 64])
@pytest.mark.parametrize("window", [None, 1, 4, 16, 100])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flex_mask_is_megabams(n, window, layout):
    """Query i sees key j iff j <= i, i - window < j and both are in one document (a contiguous run of
    equal doc_ids: an id that comes back starts a new one): the dense mask of the mask_mod, and of the
    block mask the op passes, against that rule written out."""
    docs = None if LAYOUTS[layout] is None else LAYOUTS[layout][:, :n]
    lo = key_start(docs, window, n, torch.device("cpu"))
    batch = 1 if docs is None else 2
    got = create_mask(mask_mod_of(lo), batch, 1, n, n, device="cpu")[:, 0]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    want = (j <= i) & ((i - j < window) if window is not None else True)
    if docs is not None:
        run = torch.cat([torch.zeros(2, 1, dtype=torch.long), (docs[:, 1:] != docs[:, :-1]).long()], 1).cumsum(1)
        want = want & (run[:, :, None] == run[:, None, :])
    assert torch.equal(got, want.expand(batch, n, n))
    block_mask = causal_block_mask(n, window, lo.device) if docs is None else build_block_mask(lo)
    assert torch.equal(create_mask(block_mask.mask_mod, batch, 1, n, n, device="cpu")[:, 0], want.expand(batch, n, n))


def test_block_masks_are_cached_per_length_and_window_and_rebuilt_for_documents(monkeypatch):
    """SWAX draws a window per step from a few: each one's block mask is built on its first use only;
    documents change with the batch, so their block mask is built per call."""
    causal_block_mask.cache_clear()
    built, passed = [], []
    real_build, real_flex = torch_attention.build_block_mask, torch_attention.flex_attention
    monkeypatch.setattr(torch_attention, "build_block_mask", lambda lo: built.append(lo.shape) or real_build(lo))
    monkeypatch.setattr(
        torch_attention, "flex_attention", lambda *a, **kw: passed.append(kw["block_mask"]) or real_flex(*a, **kw)
    )
    q, k, v, _ = inputs()
    for window, docs in [(8, None), (8, None), (16, None), (8, None), (None, None), (8, DOCS), (8, DOCS)]:
        bam_attention_flex(q, k, v, AttentionOptions(window=window, doc_ids=docs))
    assert built == [(1, N), (1, N), (1, N), (B, N), (B, N)]
    assert passed[0] is passed[1] is passed[3]
    assert len({id(m) for m in passed}) == 5
    assert passed[1] is causal_block_mask(N, 8, q.device)


def test_what_each_op_computes_and_refuses():
    q, k, v, s = inputs()
    learnable = {name: t.clone().requires_grad_() for name, t in GGD.items()}
    assert sdpa_causal_applies(AttentionOptions(ssmax_s=s.requires_grad_()))
    for fields in (dict(window=8), dict(doc_ids=DOCS), ALIBI):
        assert not sdpa_causal_applies(AttentionOptions(**fields))
        with pytest.raises(ValueError, match="computes no prior, window or documents"):
            bam_attention_sdpa_causal(q, k, v, AttentionOptions(**fields))
    scaled_by_learnable_s = AttentionOptions(ssmax_s=s, **ALIBI)
    for options in (AttentionOptions(**learnable), scaled_by_learnable_s):
        assert not flex_applies(options)
        with pytest.raises(ValueError, match="computes no prior gradient"):
            bam_attention_flex(q, k, v, options)
        with torch.no_grad():  # inference: nothing needs a gradient
            assert flex_applies(options)
    assert flex_applies(AttentionOptions(ssmax_s=s, ssmax_before_prior=True, **ALIBI))
    assert sdpa_backend(q.float(), k.float(), AttentionOptions()) in {
        "flash_attention",
        "efficient_attention",
        "cudnn_attention",
        "math",
    }
