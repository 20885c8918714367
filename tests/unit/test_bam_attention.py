"""kernels.bam_attention, and the same op with its tiles' elementwise passes in C
(kernels/bam_attention_cpu.py, the CPU training path), against a dense float64 reference written from
the formula (methods.md §1). Tests taking the `op` fixture run on both."""

import ctypes
import logging
import math
import platform
import shutil

import pytest
import torch
from helpers.attention_reference import dense_reference

import megabam.kernels.bam_attention as bam
import megabam.kernels.bam_attention_cpu as c_tiles
from megabam.kernels.bam_attention import AttentionOptions, bam_attention

B, H, N, D, BLOCK = 2, 3, 37, 8, 16  # N not a multiple of BLOCK on purpose


def make_inputs(dtype, seed=0, n=N, wide=False):
    g = torch.Generator().manual_seed(seed)

    def u(lo, hi, *shape):
        return (lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=torch.float64)).to(dtype)

    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    if wide:  # the NaN-safety ranges
        theta = u(-8, 4, H), u(-4, 4, H), u(-2, 2, H), u(0.1, 3, H)
    else:  # one inverted (β<0), one heavy-tailed (0<β<1) and one super-Laplace (β>1) head
        theta = u(-3, 0, H), torch.tensor([-0.7, 0.5, 1.6], dtype=dtype), u(-0.5, 0.5, H), u(0.5, 1.5, H)
    return [t.requires_grad_() for t in (q, k, v, *theta)]


@pytest.fixture(params=["reference", "c_tiles"])
def op(request):
    """The PyTorch op or the C tiles' (whose library must build here: CI's machine has a compiler)."""
    if request.param == "reference":
        return bam_attention
    assert c_tiles.library() is not None, "the C tiles did not build (see the warning logged)"
    return c_tiles.bam_attention_cpu


DOCS = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [5] * 3 + [6] * 34])


def run_both(op, dtype, ssmax, doc, window, seed=0):
    """Outputs and grads (q, k, v, θα, θβ, θμ, s) of `op` and of the float64 reference."""
    ins = make_inputs(dtype, seed)
    doc_ids = DOCS if doc else None
    s = ins[6] if ssmax else None
    options = AttentionOptions(
        theta_alpha=ins[3],
        theta_beta=ins[4],
        theta_mu=ins[5],
        ssmax_s=s,
        ssmax_before_prior=ssmax == "before",
        doc_ids=doc_ids,
        window=window,
        block_size=BLOCK,
    )
    out = op(*ins[:3], options)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    wrt = ins if ssmax else ins[:6]
    grads = torch.autograd.grad(out, wrt, dout.to(dtype))
    ref_ins = [t.detach().double().requires_grad_() for t in ins]
    ref = dense_reference(
        *ref_ins[:6], s=ref_ins[6] if ssmax else None, before_prior=ssmax == "before", doc_ids=doc_ids, window=window
    )
    ref_grads = torch.autograd.grad(ref, ref_ins if ssmax else ref_ins[:6], dout)
    return (out, *grads), (ref, *ref_grads)


def assert_close(got, want, tol):
    for name, a, b in zip(["out", "dq", "dk", "dv", "dalpha", "dbeta", "dmu", "ds"], got, want):
        err = (a.double() - b).abs().max().item()
        assert err <= tol * (1 + b.abs().max().item()), f"{name}: max err {err:.3g}"


@pytest.mark.parametrize("window", [None, 1, 7, 64])
@pytest.mark.parametrize("doc", [False, True])
@pytest.mark.parametrize("ssmax", [None, "after", "before"])
def test_matches_dense_reference(op, ssmax, doc, window):
    got, want = run_both(op, torch.float64, ssmax, doc, window)
    assert got[0].dtype == torch.float64
    assert_close(got, want, 1e-10)
    got, want = run_both(op, torch.float32, ssmax, doc, window, seed=1)
    assert got[0].dtype == torch.float32
    assert_close(got, want, 1e-4)


def test_low_precision_inputs_return_their_dtype(op):
    ins = make_inputs(torch.float64)
    options = AttentionOptions(theta_alpha=ins[3], theta_beta=ins[4], theta_mu=ins[5], ssmax_s=ins[6], block_size=BLOCK)
    ref = bam_attention(*ins[:3], options)
    for dtype in (torch.bfloat16, torch.float16):
        out = op(*(t.detach().to(dtype) for t in ins[:3]), options)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref.detach(), atol=3e-2, rtol=3e-2)


def prior_values(alpha, beta, mu=0.0, n=N):
    """The kernel's prior (1 head) for all (i, j), as float64."""
    t = [torch.tensor([x], dtype=torch.float64) for x in (alpha, beta, mu)]
    p = bam.BamParams(*t, None, False, 1.0)
    ar = torch.arange(n)
    return bam.prior_terms(p, (ar[None, :] - ar[:, None]).flatten())[0][0].view(n, n)


@pytest.mark.parametrize("beta", [0.3, 0.9, -0.5, -3.0, 2.5])
def test_prior_values(beta):
    alpha, mu = -0.4, 0.3
    got = prior_values(alpha, beta, mu)
    m = 2 * math.sinh(mu)
    want = torch.tensor(
        [[-math.exp(alpha) * (abs(j - i - m) + 1e-5) ** beta for j in range(N)] for i in range(N)], dtype=torch.float64
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_negative_beta_diagonal_is_finite_and_most_suppressed():
    p = prior_values(0.0, -2.0)
    assert torch.isfinite(p).all()
    assert torch.allclose(p.diagonal(), torch.tensor(-((1e-5) ** -2.0), dtype=torch.float64))
    off_diagonal = p.masked_fill(torch.eye(N, dtype=torch.bool), math.inf)
    assert (p.diagonal()[:, None] < off_diagonal).all()  # inverted: self is the least likely key


def test_beta_one_is_alibi_and_beta_zero_is_nope(op):
    q, k, v = make_inputs(torch.float64)[:3]
    alpha = torch.tensor([-2.0, -1.0, 0.5], dtype=torch.float64)
    one, zero = torch.ones(H, dtype=torch.float64), torch.zeros(H, dtype=torch.float64)
    # β = 1: bias -slope·|j - i| - slope·ε, the constant vanishing in the softmax.
    n = torch.arange(N)
    alibi = -torch.exp(alpha)[:, None, None] * (n[None, :] - n[:, None]).abs()
    logits = (q @ k.transpose(-1, -2) / math.sqrt(D) + alibi).masked_fill(n[None] > n[:, None], -math.inf)
    out = op(q, k, v, AttentionOptions(theta_alpha=alpha, theta_beta=one, block_size=BLOCK))
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v, rtol=0, atol=1e-12)
    # β = 0: constant prior, i.e. NoPE.
    out = op(q, k, v, AttentionOptions(theta_alpha=alpha, theta_beta=zero, block_size=BLOCK))
    torch.testing.assert_close(out, bam_attention(q, k, v, AttentionOptions(block_size=BLOCK)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ssmax", ["after", "before"])
def test_no_nan_for_wide_theta(op, dtype, ssmax):
    for seed in range(4):
        ins = make_inputs(dtype, seed, n=150, wide=True)
        options = AttentionOptions(
            theta_alpha=ins[3],
            theta_beta=ins[4],
            theta_mu=ins[5],
            ssmax_s=ins[6],
            ssmax_before_prior=ssmax == "before",
            window=100,
            doc_ids=torch.arange(150).div(60, rounding_mode="floor").expand(B, -1),
            block_size=32,
        )
        out = op(*ins[:3], options)
        grads = torch.autograd.grad(out, ins, torch.randn_like(out))
        for t in (out, *grads):
            assert torch.isfinite(t).all()
    # Extreme corners: β very negative (huge diagonal penalty) and θα, β large.
    for a, b in [(4.0, -30.0), (20.0, 8.0), (-30.0, 30.0)]:
        ins = make_inputs(dtype, n=150)
        th = [torch.full((H,), x, dtype=dtype, requires_grad=True) for x in (a, b, 0.0)] + [ins[6]]
        options = AttentionOptions(theta_alpha=th[0], theta_beta=th[1], theta_mu=th[2], ssmax_s=th[3], block_size=32)
        out = op(*ins[:3], options)
        for t in (out, *torch.autograd.grad(out, ins[:3] + th, torch.randn_like(out))):
            assert torch.isfinite(t).all()


@pytest.mark.parametrize("window", [None, 6])
def test_blocks_inside_one_document_match(op, window):
    """A query block whose rows all lie in one document that began before it needs no per-row mask
    (block_logits leaves it out: the block's first key is the document's); its rows must still see
    only their own document. One sequence, so the block's key start is that document's start."""
    g = torch.Generator().manual_seed(5)
    n = 45
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    theta = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in ([-1.0, 0.3], [0.4, 1.2], [0.7, 1.1])]
    doc = torch.tensor([[0] * 5 + [1] * 37 + [2] * 3])  # blocks of 8: rows 8..39 wholly inside document 1
    options = AttentionOptions(
        theta_alpha=theta[0], theta_beta=theta[1], ssmax_s=theta[2], doc_ids=doc, window=window, block_size=8
    )
    out = op(q, k, v, options)
    ins = [q, k, v, *theta]
    grads = torch.autograd.grad(out.square().sum(), ins)
    ref = dense_reference(q, k, v, theta[0], theta[1], None, s=theta[2], doc_ids=doc, window=window)
    ref_grads = torch.autograd.grad(ref.square().sum(), ins)
    for a, b in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_gradcheck(op):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    theta = [
        torch.tensor(x, dtype=torch.float64, requires_grad=True)
        for x in ([-1.0, 0.2], [-0.6, 1.3], [0.2, -0.1], [0.8, 1.2])
    ]
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1]])

    def f(q, k, v, a, b, m, s):
        options = AttentionOptions(
            theta_alpha=a, theta_beta=b, theta_mu=m, ssmax_s=s, doc_ids=doc, window=3, block_size=4
        )
        return op(q, k, v, options)

    assert torch.autograd.gradcheck(f, (q, k, v, *theta))


def test_no_grad_for_inputs_not_requiring_it(op):
    q, k, v, a, b, m, s = make_inputs(torch.float64)
    options = AttentionOptions(theta_alpha=a.detach(), theta_beta=b, theta_mu=m.detach(), ssmax_s=s, block_size=BLOCK)
    out = op(q, k, v.detach(), options)
    out.sum().backward()
    assert v.grad is None and a.grad is None and m.grad is None
    assert b.grad is not None and s.grad is not None and q.grad is not None


def test_window_bounds_key_columns(monkeypatch):
    """With a window, each query block touches at most block + window - 1 key columns."""
    widths, real = [], bam.block_logits

    def counting(q, k, *args):
        widths.append(k.shape[-2])
        return real(q, k, *args)

    monkeypatch.setattr(bam, "block_logits", counting)
    n, w, blk = 200, 7, 16
    ins = make_inputs(torch.float32, n=n)
    options = AttentionOptions(theta_alpha=ins[3], theta_beta=ins[4], ssmax_s=ins[6], window=w, block_size=blk)
    out = bam_attention(*ins[:3], options)
    out.sum().backward()
    assert len(widths) == 2 * math.ceil(n / blk)  # forward + backward, one call per query block
    assert max(widths) <= blk + w - 1


def test_c_tiles_window_bounds_key_columns(monkeypatch):
    """The C kernel starts each query block at the first key one of its rows sees (block_key_starts,
    the loop bound of bam_attention_cpu.c): with a window, at most its rows + window - 1 key columns."""
    starts, real = [], c_tiles.block_key_starts

    def recording(lo, n):
        starts.append(real(lo, n))
        return starts[-1]

    monkeypatch.setattr(c_tiles, "block_key_starts", recording)
    n, w, rows = 200, 7, c_tiles.tile_rows()
    ins = make_inputs(torch.float32, n=n)
    options = AttentionOptions(theta_alpha=ins[3], theta_beta=ins[4], ssmax_s=ins[6], window=w)
    out = c_tiles.bam_attention_cpu(*ins[:3], options)
    out.sum().backward()
    assert len(starts) == 2  # forward and backward
    ends = torch.arange(rows, n + rows, rows).clamp(max=n)
    for ks in starts:
        assert ks.shape == (1, math.ceil(n / rows))
        assert (ends - ks[0]).max() == rows + w - 1


@pytest.mark.parametrize("dim", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_c_tiles_head_widths_compiled_as_constants_match(dim, dtype):
    """bam_attention_cpu.c compiles D = 32, 64 and 128 as constants and its vector products for widths
    that are whole vectors (16 here: the run-time loop over vectors); the other tests use D = 8 (the
    scalar loops)."""
    assert_c_tiles_match_dense(dim, dtype)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86 instruction set")
def test_c_tiles_built_for_avx2_match(tmp_path, monkeypatch):
    """Built for a machine without AVX-512 (-march=haswell: 256-bit vectors, 16 registers; this CPU
    runs that code too), the kernel computes the same: its vector width and sums in flight follow the
    target (bam_attention_cpu.c's VBYTES, NACC)."""
    from megabam.kernels import cpu_build

    flags = [f if f != "-march=native" else "-march=haswell" for f in cpu_build.COMPILE_FLAGS]
    monkeypatch.setattr(cpu_build, "COMPILE_FLAGS", flags)
    monkeypatch.setenv("MEGABAM_CACHE", str(tmp_path))
    c_tiles.library.cache_clear()
    try:
        assert not c_tiles.wide_vectors()
        for dim in (8, 32, 64, 128):
            assert_c_tiles_match_dense(dim, torch.float32)
        assert_c_tiles_match_dense(32, torch.float64)
    finally:
        c_tiles.library.cache_clear()  # the next test loads the native build again


def assert_c_tiles_match_dense(dim, dtype):
    """The C kernel's output and gradients (q, k, v, θα, θβ, s) against the float64 dense reference, at
    head width `dim`: 150 rows (two full 64-row blocks and a partial one), causal, then a window wider
    than a block with documents."""
    g = torch.Generator().manual_seed(dim)
    n, heads = 150, 2
    q, k, v = (torch.randn(1, heads, n, dim, generator=g, dtype=dtype, requires_grad=True) for _ in range(3))
    theta = [torch.tensor(x, dtype=dtype, requires_grad=True) for x in ([-1.0, -2.0], [-0.6, 1.3], [0.2, 1.0])]
    docs = torch.tensor([[0] * 40 + [1] * 110])
    for masks in (dict(), dict(window=90, doc_ids=docs)):
        options = AttentionOptions(theta_alpha=theta[0], theta_beta=theta[1], ssmax_s=theta[2], **masks)
        out = c_tiles.bam_attention_cpu(q, k, v, options)
        dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
        got = (out, *torch.autograd.grad(out, (q, k, v, *theta), dout.to(dtype)))
        ref_ins = [t.detach().double().requires_grad_() for t in (q, k, v, *theta)]
        ref = dense_reference(*ref_ins[:5], None, s=ref_ins[5], **masks)
        want = (ref, *torch.autograd.grad(ref, ref_ins, dout))
        names = ["out", "dq", "dk", "dv", "dalpha", "dbeta", "ds"]
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        for name, a, b in zip(names, got, want):
            err = (a.double() - b).abs().max().item()
            assert err <= tol * (1 + b.abs().max().item()), f"{name} {masks}: max err {err:.3g}"


def test_c_tiles_same_result_on_one_and_two_threads():
    """The C passes split the work over torch's OpenMP threads by (batch, head): each head's sums are
    made by one thread in one order, so the result does not depend on the thread count."""
    threads = torch.get_num_threads()
    results = []
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            ins = make_inputs(torch.float32, n=90)
            options = AttentionOptions(
                theta_alpha=ins[3], theta_beta=ins[4], ssmax_s=ins[6], doc_ids=DOCS[:, :1].expand(B, 90)
            )
            out = c_tiles.bam_attention_cpu(*ins[:3], options)
            results.append([out, *torch.autograd.grad(out.square().sum(), ins[:5] + ins[6:])])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_c_tiles_build_is_cached_and_a_failed_build_falls_back(tmp_path, monkeypatch, caplog):
    """The library is built once per cache (a second build returns the same file untouched); a
    compiler that fails leaves library() None with a warning naming the command, and then the
    dispatch point runs the PyTorch reference."""
    from helpers.dispatch_spy import spy_on_ops

    from megabam.kernels import cpu_build, dispatch

    compiler = shutil.which("cc") or shutil.which("gcc")
    built = cpu_build.build(c_tiles.SOURCE, compiler, tmp_path)
    stamp = built.stat().st_mtime_ns
    assert cpu_build.build(c_tiles.SOURCE, compiler, tmp_path) == built and built.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporary files left

    monkeypatch.setenv("MEGABAM_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("CC", "false")
    c_tiles.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
            assert c_tiles.library() is None
        assert "fused CPU attention tiles unavailable" in caplog.text and "false" in caplog.text
        ran = spy_on_ops(monkeypatch, (dispatch, "bam_attention"), c_tiles=(c_tiles, "bam_attention_cpu"))
        ins = make_inputs(torch.float32)
        dispatch.attention(*ins[:3], AttentionOptions(theta_alpha=ins[3], theta_beta=ins[4], ssmax_s=ins[6]))
        assert ran == ["reference"]
    finally:
        c_tiles.library.cache_clear()  # the next test builds or loads from the real cache again


def test_c_build_is_redone_when_an_included_header_changes(tmp_path):
    """A source's headers (bam_attention_cpu.c's kernels are in bam_attention_cpu_impl.h) are found
    beside it and are part of the cache key: an edited header builds a new library instead of loading
    the one built before the edit."""
    from megabam.kernels import cpu_build

    compiler = shutil.which("cc") or shutil.which("gcc")
    source, header = tmp_path / "src" / "lib.c", tmp_path / "src" / "lib_impl.h"
    source.parent.mkdir()
    source.write_text('#include "lib_impl.h"\n')
    header.write_text("int answer(void) { return 1; }\n")
    first = cpu_build.build(source, compiler, tmp_path / "cache")
    header.write_text("int answer(void) { return 2; }\n")
    second = cpu_build.build(source, compiler, tmp_path / "cache")
    assert second != first and ctypes.CDLL(str(second)).answer() == 2


# --- grouped-query attention: k, v with H_kv | H heads ------------------------------------------


def gqa_inputs(dtype, heads, kv_heads, seed=0):
    """q (B, heads, N, D), k, v (B, kv_heads, N, D) and per-query-head θ with β from -0.7 (inverted)
    to 1.6 (super-Laplace); all require grad."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, N, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, kv_heads, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    alpha = -3 * torch.rand(heads, generator=g, dtype=torch.float64)
    beta = torch.linspace(-0.7, 1.6, heads, dtype=torch.float64)
    mu = torch.rand(heads, generator=g, dtype=torch.float64) - 0.5
    s = 0.5 + torch.rand(heads, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v, alpha, beta, mu, s)]


@pytest.mark.parametrize("doc, window", [(False, None), (True, 7), (False, 1)])
@pytest.mark.parametrize("ssmax", [None, "after", "before"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 1), (3, 3), (6, 3)])
def test_gqa_matches_dense_reference_with_repeated_kv(op, heads, kv_heads, ssmax, doc, window):
    """Query head h uses kv head h // (H / H_kv): the op on (B, H_kv, N, D) k, v against the dense
    formula on k, v repeated per query head explicitly, whose dk, dv are summed over each group."""
    group = heads // kv_heads
    doc_ids = DOCS if doc else None
    for dtype, tol, seed in ((torch.float64, 1e-10, 0), (torch.float32, 1e-4, 1)):
        ins = gqa_inputs(dtype, heads, kv_heads, seed)
        s = ins[6] if ssmax else None
        options = AttentionOptions(
            theta_alpha=ins[3],
            theta_beta=ins[4],
            theta_mu=ins[5],
            ssmax_s=s,
            ssmax_before_prior=ssmax == "before",
            doc_ids=doc_ids,
            window=window,
            block_size=BLOCK,
        )
        out = op(*ins[:3], options)
        assert out.shape == ins[0].shape and out.dtype == dtype
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        wrt = ins if ssmax else ins[:6]
        got = [out, *torch.autograd.grad(out, wrt, dout.to(dtype))]
        assert got[2].shape == got[3].shape == (B, kv_heads, N, D)

        # The formula on explicit per-query-head copies (leaves of their own).
        heads_kv = torch.arange(heads) // group
        q, k, v, *theta = [t.detach().double() for t in ins]
        ref_ins = [q, k[:, heads_kv], v[:, heads_kv], *theta]
        ref_ins = [t.clone().requires_grad_() for t in ref_ins]
        ref = dense_reference(
            *ref_ins[:6],
            s=ref_ins[6] if ssmax else None,
            before_prior=ssmax == "before",
            doc_ids=doc_ids,
            window=window,
        )
        ref_grads = list(torch.autograd.grad(ref, ref_ins if ssmax else ref_ins[:6], dout))
        for i in (1, 2):  # dk, dv: the sum over the query heads of each group
            ref_grads[i] = ref_grads[i].view(B, kv_heads, group, N, D).sum(2)
        assert_close(got, [ref, *ref_grads], tol)


@pytest.mark.parametrize(
    "heads, kv_heads, match",
    [
        (4, 3, "k and v have 3 heads, which does not divide q's 4 heads"),
        (2, 4, "k and v have 4 heads, which does not divide q's 2 heads"),
    ],
)
def test_gqa_rejects_head_counts_not_dividing(op, heads, kv_heads, match):
    q, k, v = gqa_inputs(torch.float32, heads, kv_heads)[:3]
    with pytest.raises(ValueError, match=match):
        op(q, k, v)
    with pytest.raises(ValueError, match="same number of heads, got 1 and 2"):
        op(q, k[:, :1], torch.cat([v, v], 1)[:, :2])


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(theta_alpha=torch.zeros(H)), "theta_alpha and theta_beta must be given together"),
        (dict(theta_beta=torch.zeros(H)), "theta_alpha and theta_beta must be given together"),
        (dict(theta_mu=torch.zeros(H)), "theta_mu needs theta_alpha and theta_beta"),
        (dict(window=0), "window must be >= 1, got 0"),
    ],
)
def test_options_refuse_incomplete_priors_and_empty_windows(options, match):
    """The options' own rules hold when they are made, before any op sees them."""
    with pytest.raises(ValueError, match=match):
        AttentionOptions(**options)


def test_options_are_frozen_and_compared_by_identity():
    """Frozen, so no op can change a call's options; == and hash by identity, so comparing or hashing
    options never compares their tensors (which has no single truth value)."""
    options = AttentionOptions(theta_alpha=torch.zeros(H), theta_beta=torch.ones(H))
    with pytest.raises(AttributeError):
        options.window = 4
    twin = AttentionOptions(theta_alpha=options.theta_alpha, theta_beta=options.theta_beta)
    assert options == options and options != twin and len({options, twin}) == 2


def test_dense_attention_refuses_documents():
    """A stream is one document: dense_bam_attention has no document mask, so doc_ids are refused."""
    q = torch.zeros(1, H, 4, D)
    positions = torch.arange(4)
    with pytest.raises(ValueError, match="doc_ids must be None"):
        bam.dense_bam_attention(q, q, q, positions, positions, AttentionOptions(doc_ids=torch.zeros(1, 4)))
