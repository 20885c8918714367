"""The Triton BAM kernel (kernels/bam_attention_triton.py) against the PyTorch reference, on CPU under
the Triton interpreter, and the model's attention reaching the kernel through the dispatch point
(kernels/dispatch.py; its own rules are tested in tests/unit/test_dispatch.py).

TRITON_INTERPRET=1 is set here, in-process, before the kernel module is imported: triton.jit and
triton.autotune read it when they decorate a kernel (at import), and Triton reads it again at the
first launch, so it stays set for the rest of the session (tests/unit/test_mlstm_triton.py sets it the same way). A
subprocess per check would be just as correct but pays a torch import (seconds) per check and
reports failures second-hand; in-process is robust as long as nothing imported the kernel module
earlier without the flag (the package never does: dispatch imports it lazily), which the assert
below checks. Compiling for the GPU (the flag off) is tests/unit/test_kernel_budget.py's.

Reference: kernels.bam_attention in float64 on the same inputs (itself checked against a dense
float64 formula in tests/unit/test_bam_attention.py). Tolerance on max |error| / (1 + max |reference|)
per output and gradient: 3e-5 for fp32 inputs, 2e-3 for fp16 inputs (outputs and dq, dk, dv are
rounded to fp16). bf16 (1.5e-2) runs too: loads are upcast to fp32 at once, so the interpreter's
wrong bf16 arithmetic is never used. Grouped-query attention (k, v with H_kv | H heads, dk, dv
summed over each group) and θβ across [-6, 3] are held to the same tolerances. Measured worst cases
over the file with the prior read from tables (exp2 logits): fp32 6.7e-6 (ds), fp16 6.5e-4 (dμ),
bf16 4.5e-3 (dk). Shapes are small (N = 37 and 64, D = 16, interpreter tiles of 16) so the file
runs in about a minute on two cores. Determinism (two backward passes bit-equal) is checked here
too; the compiled kernels' instruction budget is tests/unit/test_kernel_budget.py's.
"""

import math
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: E402
from helpers.dispatch_spy import spy_on_ops  # noqa: E402

import megabam.kernels.bam_attention_triton as kt  # noqa: E402
from megabam.kernels import dispatch  # noqa: E402
from megabam.kernels.bam_attention import AttentionOptions, bam_attention  # noqa: E402

assert kt.INTERPRET, "kernels.bam_attention_triton was imported before TRITON_INTERPRET=1 was set"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B, H, N, D = 2, 3, 37, 16  # N not a multiple of the interpreter's tile (16) on purpose
DOCS = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [5] * 3 + [6] * 34])
TOL = {torch.float32: 3e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
NAMES = ["out", "dq", "dk", "dv", "dalpha", "dbeta", "dmu", "ds"]


def make_inputs(dtype, seed=0, n=N):
    """q, k, v in `dtype` and fp32 (θα, θβ, θμ, s): one inverted (β < 0), one heavy-tailed and one
    super-Laplace (β > 1) head, the rest drawn at random; all require grad."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for _ in range(3))
    alpha = -3 * torch.rand(H, generator=g)
    beta = torch.tensor([-0.7, 0.5, 1.6]) + 0.2 * torch.rand(H, generator=g)
    mu = torch.rand(H, generator=g) - 0.5
    s = 0.5 + torch.rand(H, generator=g)
    return [t.requires_grad_() for t in (q, k, v, alpha, beta, mu, s)]


def gqa_inputs(dtype, heads, kv_heads, seed=0, n=N):
    """q (B, heads, n, D) and k, v (B, kv_heads, n, D) in `dtype`, fp32 per-query-head θ with β from
    -0.7 (inverted) to 1.6 (super-Laplace); all require grad."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, n, D, generator=g).to(dtype)
    k, v = (torch.randn(B, kv_heads, n, D, generator=g).to(dtype) for _ in range(2))
    alpha = -3 * torch.rand(heads, generator=g)
    beta = torch.linspace(-0.7, 1.6, heads)
    mu = torch.rand(heads, generator=g) - 0.5
    s = 0.5 + torch.rand(heads, generator=g)
    return [t.requires_grad_() for t in (q, k, v, alpha, beta, mu, s)]


def grads_of(op, ins, kw, wrt, dout):
    out = op(*ins[:3], AttentionOptions(**kw))
    return [out, *torch.autograd.grad(out, [ins[i] for i in wrt], dout.to(out.dtype))]


def compare(ins, kw, wrt=range(7), seed=1):
    """Max relative errors of the kernel's output and gradients (w.r.t. ins[i] for i in wrt) against
    the float64 reference; asserts they are within TOL of the inputs' dtype."""
    dtype = ins[0].dtype
    dout = torch.randn(ins[0].shape, generator=torch.Generator().manual_seed(seed))
    got = grads_of(kt.bam_attention_triton, ins, kw, wrt, dout)
    ref_ins = [t.detach().double().requires_grad_() for t in ins]
    position = {id(t): i for i, t in enumerate(ins)}  # θ arguments map to their float64 copies
    ref_kw = {key: ref_ins[position[id(val)]] if id(val) in position else val for key, val in kw.items()}
    want = grads_of(bam_attention, ref_ins, ref_kw, wrt, dout.double())
    assert got[0].dtype == dtype and all(g.dtype == ins[i].dtype for g, i in zip(got[1:], wrt))
    names = ["out"] + [NAMES[1 + i] for i in wrt]
    errors = {}
    for name, a, b in zip(names, got, want):
        errors[name] = (a.double() - b).abs().max().item() / (1 + b.abs().max().item())
    bad = {k: v for k, v in errors.items() if not v <= TOL[dtype]}
    assert not bad, f"over {TOL[dtype]}: {bad}"
    return errors


def bam_kwargs(ins, ssmax, doc, window):
    return dict(
        theta_alpha=ins[3],
        theta_beta=ins[4],
        theta_mu=ins[5],
        ssmax_s=ins[6] if ssmax else None,
        ssmax_before_prior=ssmax == "before",
        doc_ids=DOCS if doc else None,
        window=window,
    )


# Every pair of (window, documents, SSMax) values in 12 cases instead of all 24: each window with each
# SSMax order, documents on in half of them, alternating so that each window and each SSMax order
# runs with and without documents (the interpreter's time is the file's).
PAIRS = [
    (window, (w + o) % 2 == 1, ssmax)
    for w, window in enumerate([None, 1, 16, 64])
    for o, ssmax in enumerate([None, "after", "before"])
]


@pytest.mark.parametrize("window, doc, ssmax", PAIRS)
def test_fp32_matches_reference(ssmax, doc, window):
    ins = make_inputs(torch.float32, seed=window or 0)
    compare(ins, bam_kwargs(ins, ssmax, doc, window), wrt=range(7) if ssmax else range(6))


# fp16 changes the inputs' and outputs' rounding, not the masks: each SSMax order once, both windows.
@pytest.mark.parametrize("ssmax, window", [(None, 16), ("after", None), ("before", 16)])
def test_fp16_matches_reference(ssmax, window):
    ins = make_inputs(torch.float16, seed=3)
    compare(ins, bam_kwargs(ins, ssmax, True, window), wrt=range(7) if ssmax else range(6))


@pytest.mark.parametrize("ssmax", [None, "after"])
def test_bf16_matches_reference(ssmax):
    ins = make_inputs(torch.bfloat16, seed=3)
    compare(ins, bam_kwargs(ins, ssmax, True, 16), wrt=range(7) if ssmax else range(6))


@pytest.mark.parametrize("ssmax", [None, "after"])
def test_nope_and_alibi(ssmax):
    """No prior (NoPE) and ALiBi (β = 1, μ absent): the kernel's prior-less and μ-less paths."""
    ins = make_inputs(torch.float32, seed=5)
    s = ins[6] if ssmax else None
    compare(ins, dict(ssmax_s=s, doc_ids=DOCS), wrt=[0, 1, 2, 6] if ssmax else [0, 1, 2])
    alibi = [ins[3], torch.ones(H, requires_grad=True)]
    ins = ins[:3] + alibi + [torch.zeros(H), ins[6]]
    compare(
        ins,
        dict(theta_alpha=ins[3], theta_beta=ins[4], ssmax_s=s, window=16),
        wrt=[0, 1, 2, 3, 4, 6] if ssmax else range(5),
    )


@pytest.mark.parametrize(
    "heads, kv_heads, ssmax, doc, window",
    [(4, 2, "after", True, 16), (3, 3, "before", False, None), (3, 1, None, True, 20)],
)
def test_extreme_prior_shapes_match_reference(heads, kv_heads, ssmax, doc, window):
    """θβ across [-6, 3] (from a prior concentrated on the diagonal to a steep super-Laplace one) with
    μ ≠ 0 on every head but one; the head with μ = 0 and β = -6 puts an exponent past EXP_CAP on the
    diagonal (|d| + ε = 1e-5), where the prior is capped and its θ gradients stop. All of out, dq,
    dk, dv, dθα, dθβ, dθμ (and ds with SSMax), N = 37, against the float64 reference."""
    ins = gqa_inputs(torch.float32, heads, kv_heads, seed=heads + 7)
    ins[4] = torch.linspace(-6.0, 3.0, heads).requires_grad_()
    ins[5] = torch.linspace(0.0, 0.6, heads).requires_grad_()
    compare(ins, bam_kwargs(ins, ssmax, doc, window), wrt=range(7) if ssmax else range(6))


@pytest.mark.parametrize(
    "heads, kv_heads, ssmax, doc, window", [(3, 3, "after", False, None), (4, 2, "before", True, 30)]
)
def test_ssmax_key_cap_matches_reference(heads, kv_heads, ssmax, doc, window):
    """SSMax's key count capped per head (AttentionOptions.ssmax_key_cap; inf: none): rows past a cap
    of 5 or 20 keys, at N = 37, in a local, a flat and an inverted head, with grouped kv heads,
    documents and a window. Out and every gradient (ds with the capped ln n_i) against the float64
    reference."""
    ins = gqa_inputs(torch.float32, heads, kv_heads, seed=11)
    ins[4] = torch.linspace(1.5, -0.5, heads).requires_grad_()
    cap = torch.tensor([5.0, 20.0, math.inf, 5.0][:heads])
    errors = compare(ins, {**bam_kwargs(ins, ssmax, doc, window), "ssmax_key_cap": cap})
    # The cap changes the result: the same inputs uncapped are far from the capped reference.
    ref = bam_attention(
        *(t.detach().double() for t in ins[:3]),
        AttentionOptions(
            **{**bam_kwargs([t.detach().double() for t in ins], ssmax, doc, window), "ssmax_key_cap": cap}
        ),
    )
    got = kt.bam_attention_triton(
        *(t.detach() for t in ins[:3]), AttentionOptions(**bam_kwargs(ins, ssmax, doc, window))
    )
    assert (got.double() - ref).abs().max() > 100 * TOL[torch.float32], errors


def test_backward_is_deterministic():
    """Two backward passes give bit-equal gradients: the θ, s gradients are per-row partial sums
    reduced on the host, dk, dv are summed over the group in a fixed order (no atomics anywhere)."""
    ins = gqa_inputs(torch.float32, 4, 2, seed=19)
    kw = bam_kwargs(ins, "after", True, 16)
    dout = torch.randn(ins[0].shape, generator=torch.Generator().manual_seed(3))
    runs = [grads_of(kt.bam_attention_triton, ins, kw, range(7), dout) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_strided_inputs_and_several_tiles():
    """q, k, v as the attention mixer passes them (a permuted view of one qkv tensor), N = 64."""
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(B, 64, 3, H, D, generator=g).permute(2, 0, 3, 1, 4)
    q, k, v = (t.requires_grad_() for t in qkv.clone().unbind(0))
    assert not q.is_contiguous()
    ins = [q, k, v, *make_inputs(torch.float32, n=64)[3:]]
    compare(ins, bam_kwargs(ins, "after", False, None))


@pytest.mark.parametrize("ssmax", ["after", "before"])
def test_no_nan_for_wide_theta(ssmax):
    """The reference's NaN-safety ranges and corners (tests/unit/test_bam_attention.py): all finite."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, H, 40, D, generator=g).requires_grad_() for _ in range(3))
    wide = [lo + (hi - lo) * torch.rand(H, generator=g) for lo, hi in ((-8, 4), (-4, 4), (-2, 2), (0.1, 3))]
    corners = [torch.tensor(x) for x in ([4.0, 20.0, -30.0], [-30.0, 8.0, 30.0], [0.0, 0.0, 0.0], [1.0] * 3)]
    docs = torch.arange(40).div(15, rounding_mode="floor").expand(B, -1)
    for theta in (wide, corners):
        theta = [t.requires_grad_() for t in theta]
        options = AttentionOptions(
            theta_alpha=theta[0],
            theta_beta=theta[1],
            theta_mu=theta[2],
            ssmax_s=theta[3],
            ssmax_before_prior=ssmax == "before",
            window=20,
            doc_ids=docs,
        )
        out = kt.bam_attention_triton(q, k, v, options)
        for t in (out, *torch.autograd.grad(out, [q, k, v, *theta], torch.randn(out.shape, generator=g))):
            assert torch.isfinite(t).all()


def test_no_grad_for_inputs_not_requiring_it():
    q, k, v, a, b, m, s = make_inputs(torch.float32)
    options = AttentionOptions(theta_alpha=a.detach(), theta_beta=b, theta_mu=m.detach(), ssmax_s=s)
    out = kt.bam_attention_triton(q, k, v.detach(), options)
    out.sum().backward()
    assert v.grad is None and a.grad is None and m.grad is None
    assert all(t.grad is not None for t in (q, k, b, s))


@pytest.mark.parametrize("heads, kv_heads", [(H, H), (4, 2)])
def test_poisoned_outputs_are_overwritten(heads, kv_heads):
    """Every element of out, stats, top, dq, dk and dv is written: NaN-filled (or -1-filled) buffers come
    back finite and equal to freshly allocated ones (also with grouped-query attention: dk, dv of k's
    shape)."""
    q, k, v, a, b, m, s = (t.detach() for t in gqa_inputs(torch.float32, heads, kv_heads))
    lo, last = kt.key_bounds(DOCS, 16, N, q.device)
    cfg = (False, D**-0.5)
    bufs = []
    for fill in (0.0, math.nan):
        out = torch.full((B, heads, N, D), fill)
        stats = torch.full((B, heads, N, 2), fill)
        top = torch.full((B, heads, N), 0 if fill == 0 else -1, dtype=torch.int32)
        kt.forward(q, k, v, lo, a, b, m, s, *cfg, out, stats, top)
        dq = torch.full((B, heads, N, D), fill)
        dk, dv = (torch.full((B, kv_heads, N, D), fill) for _ in range(2))
        dout = torch.randn(B, heads, N, D, generator=torch.Generator().manual_seed(2))
        kt.backward(q, k, v, out, dout, stats, top, lo, last, a, b, m, s, *cfg, dq, dk, dv)
        bufs.append((out, stats, top, dq, dk, dv))
    for clean, poisoned in zip(*bufs):
        assert torch.isfinite(poisoned).all()
        torch.testing.assert_close(poisoned, clean, rtol=0, atol=0)


class _TileSpy:
    """Counts evaluations of the kernels' per-tile logits (the interpreter calls it as Python)."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


@pytest.mark.parametrize("window, tiles, heads", [(None, 10, 1), (1, 4, 1), (16, 7, 1), (16, 7, 2)])
def test_window_skips_key_tiles(monkeypatch, window, tiles, heads):
    """N = 64 is 4 row blocks of 16: full causal visits 1+2+3+4 key tiles, a window of w at most
    ceil((16 + w - 1) / 16) + 1 per block (here 1 for w = 1; 1, 2, 2, 2 for w = 16). Forward and
    both backward kernels visit the same tiles, per query head: with 2 query heads sharing one kv
    head, the dk/dv kernel's program loops over both."""
    spy = _TileSpy(kt.tile)
    monkeypatch.setattr(kt, "tile", spy)
    q = torch.randn(1, heads, 64, D, requires_grad=True)
    k, v = (torch.randn(1, 1, 64, D, requires_grad=True) for _ in range(2))
    out = kt.bam_attention_triton(q, k, v, AttentionOptions(window=window))
    tiles *= heads
    assert spy.calls == tiles
    out.sum().backward()
    assert spy.calls == 3 * tiles


def test_tiles_the_prior_empties_are_skipped_bit_for_bit(monkeypatch):
    """Tiles whose every score the prior puts more than exp2's underflow below its row's max add
    exactly 0: the kernels skip them (SKIP_EMPTY_TILES) and every output and gradient keeps its bits.
    Three heads over N = 64 (4 row blocks of 16): a local one (θα 2, θβ 2: the prior at offset 17 is
    -e²·17² ≈ -2,100), one peaked 24 keys back (μ = 2·sinh θμ ≈ -24; the backward, which knows each
    row's final max, skips even the diagonal tile there), and a weak one (θα -3) that skips nothing."""
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, 3, 64, D, generator=g) for _ in range(4))
    thetas = [[2.0, 2.0, -3.0], [2.0, 2.0, 1.0], [0.0, -math.asinh(12.0), 0.0], [1.0, 0.8, 1.2]]
    runs = {}
    for skip in (False, True):
        monkeypatch.setattr(kt, "SKIP_EMPTY_TILES", skip)
        spy = _TileSpy(kt.tile)
        monkeypatch.setattr(kt, "tile", spy)
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        th = [torch.tensor(t, requires_grad=True) for t in thetas]
        options = AttentionOptions(theta_alpha=th[0], theta_beta=th[1], theta_mu=th[2], ssmax_s=th[3])
        out = kt.bam_attention_triton(*ins, options)
        forward_tiles = spy.calls
        grads = torch.autograd.grad(out, [*ins, *th], dout)
        runs[skip] = (out, *grads), (forward_tiles, spy.calls - forward_tiles)
        monkeypatch.setattr(kt, "tile", spy.real)
    (full, (fwd_all, bwd_all)), (skipped, (fwd, bwd)) = runs[False], runs[True]
    assert (fwd_all, bwd_all) == (30, 60)  # 3 heads × 10 tiles, twice in the backward
    assert fwd < fwd_all and bwd < bwd_all - 6, (fwd, bwd)
    for name, a, b in zip(NAMES, skipped, full):
        assert torch.equal(a, b), name


# --- grouped-query attention -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, heads, kv_heads, ssmax, doc, window",
    [
        (torch.float32, 4, 2, "after", True, 16),
        (torch.float32, 4, 1, "before", False, None),
        (torch.float32, 4, 2, None, True, None),
        (torch.float32, 3, 3, "after", False, 16),
        (torch.float16, 4, 2, "after", True, 16),
    ],
)
def test_gqa_matches_reference(dtype, heads, kv_heads, ssmax, doc, window):
    """k, v with H_kv | H heads (N = 37, not a multiple of the tile) against the reference (itself
    checked against the dense formula on explicitly repeated k, v): out, dq, dk and dv (summed over
    each group's query heads) and the per-query-head θ, s gradients."""
    ins = gqa_inputs(dtype, heads, kv_heads, seed=heads + kv_heads)
    errors = compare(ins, bam_kwargs(ins, ssmax, doc, window), wrt=range(7) if ssmax else range(6))
    assert errors.keys() >= {"dk", "dv"}


def test_an_older_triton_leaves_out_the_dkdv_tile_it_spills_with_grouped_heads(monkeypatch):
    """Triton 3.6 (the GPU image's) spills dk/dv's 16x64 4-warp tile at GROUP > 1 and 3.9 does not
    (docs/benchmarks.md, "Instruction budget"): under an older Triton the autotuner's prune leaves it
    out for grouped heads only; the interpreter's one tile is never left out."""
    tiles = [triton.Config({"BLOCK_M": 16, "BLOCK_N": n}, num_warps=w) for n, w in ((128, 8), (64, 4))]
    interpreter = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4)]
    assert kt.bwd_dkdv_kernel.early_config_prune is kt._no_spilling_group_tiles
    for older, group, kept in [(True, 4, tiles[:1]), (True, 1, tiles), (False, 4, tiles)]:
        monkeypatch.setattr(kt, "SPILLS_GROUPED_W4", older)
        assert kt._no_spilling_group_tiles(tiles, {"GROUP": group}) == kept, (older, group)
        assert kt._no_spilling_group_tiles(interpreter, {}, GROUP=group) == interpreter


def test_gqa_strided_kv_and_repeated_kv_agree():
    """k, v as non-contiguous views (the mixer's layout), and the kernel with k, v repeated per query
    head: the same output bit for bit (same tiles, same arithmetic) and dk, dv equal to the repeated
    run's gradients summed over each group (up to the order of the fp32 sums)."""
    g = torch.Generator().manual_seed(13)
    q = torch.randn(B, 4, N, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, N, 2, D, generator=g).transpose(1, 2).requires_grad_() for _ in range(2))
    assert not k.is_contiguous()
    theta = [t.detach().requires_grad_() for t in gqa_inputs(torch.float32, 4, 2)[3:]]
    options = AttentionOptions(
        theta_alpha=theta[0], theta_beta=theta[1], theta_mu=theta[2], ssmax_s=theta[3], doc_ids=DOCS, window=16
    )
    dout = torch.randn(B, 4, N, D, generator=g)
    out = kt.bam_attention_triton(q, k, v, options)
    got = torch.autograd.grad(out, [q, k, v, *theta], dout)
    k_rep, v_rep = (t.detach().repeat_interleave(2, 1).requires_grad_() for t in (k, v))
    rep = kt.bam_attention_triton(q, k_rep, v_rep, options)
    want = list(torch.autograd.grad(rep, [q, k_rep, v_rep, *theta], dout))
    want[1], want[2] = (w.view(B, 2, 2, N, D).sum(2) for w in want[1:3])
    assert torch.equal(out, rep)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_gqa_rejects_head_counts_not_dividing():
    q, k, v = gqa_inputs(torch.float32, 4, 3)[:3]
    with pytest.raises(ValueError, match="k and v have 3 heads, which does not divide q's 4 heads"):
        kt.bam_attention_triton(q, k, v)


def test_rejects_unsupported_dtype():
    q = torch.randn(1, 1, 8, D, dtype=torch.float64)
    with pytest.raises(TypeError, match="fp32, fp16 or bf16"):
        kt.bam_attention_triton(q, q, q)


# --- the model through the dispatch point ----------------------------------------------------------


@pytest.fixture
def ops(monkeypatch):
    """Records which op the dispatch point ran ("reference" / "triton")."""
    return spy_on_ops(monkeypatch, (dispatch, "bam_attention"), (kt, "bam_attention_triton"))


def test_model_kernels_config_reaches_the_mixer(ops):
    from megabam.config import ConfigError, load_config
    from megabam.model.attention import build_attention
    from megabam.model.layers import SequenceInfo

    with pytest.raises(ConfigError, match="model.kernels: 'gpu' is not one of auto, triton, reference"):
        load_config(None, ["model.kernels=gpu"])
    cfg = load_config(None, ["model.kernels=triton", "model.d_model=32", "model.n_heads=2"]).model
    layer = build_attention(cfg, {})
    layer(torch.randn(1, 20, 32), SequenceInfo())
    assert ops == ["triton"]
