"""SSMax's key cap (model.attention.ssmax_key_cap): n_i stops at the cap in heads whose prior decays,
so such heads keep past the training length the sharpness they trained with (docs/results.md)."""

import math

import pytest
import torch
from helpers.attention_reference import dense_reference
from helpers.dispatch_spy import spy_on_ops

import megabam.kernels.bam_attention_cpu as c_tiles
from megabam.config import ConfigError, load_config
from megabam.eval.generate import predict_next, token_losses
from megabam.kernels import dispatch
from megabam.kernels.bam_attention import AttentionOptions, bam_attention, dense_bam_attention
from megabam.model import Decoder
from megabam.model.attention import Attention
from megabam.model.layers import SequenceInfo

CONFIG = "yaml_configs/tiny_cpu.yaml"
B, H, N, D, BLOCK = 2, 3, 37, 8, 16
CAPS = torch.tensor([math.inf, 5.0, 12.0], dtype=torch.float64)  # one head uncapped, two capped below N
DOCS = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [5] * 3 + [6] * 34])


def inputs(seed):
    """q, k, v, θα, θβ (one inverted, one heavy-tailed, one steep head), θμ, s; float64, requiring grad."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    alpha = -3 * torch.rand(H, generator=g, dtype=torch.float64)
    beta = torch.tensor([-0.7, 0.5, 1.6], dtype=torch.float64)
    mu = torch.rand(H, generator=g, dtype=torch.float64) - 0.5
    s = 0.5 + torch.rand(H, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, alpha, beta, mu, s)]


def options(ins, **fields):
    return AttentionOptions(*ins[3:6], ssmax_s=ins[6], block_size=BLOCK, **fields)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("doc", [False, True])
@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("op", ["tiled", "c_tiles"])
def test_capped_op_matches_the_plain_formula(op, before, doc, window):
    """The tiled op's and the C kernel's output and every gradient, in float64, against attention
    written from the formula with n_i replaced by min(n_i, cap_h). (The Triton kernel's:
    tests/unit/test_kernels_triton.py.)"""
    if op == "c_tiles" and c_tiles.library() is None:
        pytest.skip("the C kernel does not build here")
    ins = inputs(2)
    masks = dict(doc_ids=DOCS if doc else None, window=window)
    run = bam_attention if op == "tiled" else c_tiles.bam_attention_cpu
    out = run(*ins[:3], options(ins, ssmax_before_prior=before, ssmax_key_cap=CAPS, **masks))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = (out, *torch.autograd.grad(out, ins, dout))
    ref_ins = [t.detach().requires_grad_() for t in ins]
    ref = dense_reference(*ref_ins[:6], s=ref_ins[6], before_prior=before, key_cap=CAPS, **masks)
    want = (ref, *torch.autograd.grad(ref, ref_ins, dout))
    for name, a, b in zip(["out", "dq", "dk", "dv", "dalpha", "dbeta", "dmu", "ds"], got, want):
        assert (a - b).abs().max() <= 1e-10 * (1 + b.abs().max()), name
    uncapped = dense_reference(*ref_ins[:6], s=ref_ins[6], before_prior=before, **masks)
    assert (out - uncapped).abs().max() > 1e-3  # the caps change the result: the test can tell


def test_streaming_ops_apply_the_cap():
    """dense_bam_attention (inference against a KV cache), computed in order and densely, equals the
    tiled op with the cap."""
    q, k, v, *theta = (t.detach() for t in inputs(3))
    capped = AttentionOptions(*theta[:3], ssmax_s=theta[3], ssmax_key_cap=CAPS)
    whole = bam_attention(q, k, v, capped)
    pos = torch.arange(N)
    for in_order in (True, False):
        last = dense_bam_attention(q[:, :, 20:], k, v, pos[20:], pos, capped, in_order=in_order)
        torch.testing.assert_close(last, whole[:, :, 20:], rtol=0, atol=1e-12)


def test_caps_no_row_reaches_change_nothing():
    """A call no longer than the smallest cap (every training call: the cap is at least data.seq_len)
    computes what it computes without one, bit for bit."""
    ins = [t.detach() for t in inputs(4)]
    caps = torch.tensor([math.inf, N, N + 3.0], dtype=torch.float64)
    capped, plain = options(ins, ssmax_key_cap=caps), options(ins)
    assert torch.equal(bam_attention(*ins[:3], capped), bam_attention(*ins[:3], plain))
    assert not dispatch.key_cap_reached(ins[0], capped)
    assert dispatch.key_cap_reached(ins[0][:, :, :-1], options(ins, ssmax_key_cap=caps - 2))


def test_dispatch_sends_calls_that_reach_a_cap_to_an_op_that_applies_it(monkeypatch):
    """On CPU the C kernel applies the cap; torch's fused attention, which the dispatch picks for a
    fixed prior where the C kernel was built for narrower vectors, does not: the C kernel takes the
    calls that reach a cap there too, and the tiled op where the C kernel is not built."""
    ran = spy_on_ops(
        monkeypatch,
        (dispatch, "bam_attention"),
        c_tiles=(c_tiles, "bam_attention_cpu"),
        sdpa=(dispatch.bam_attention_sdpa, "bam_attention_sdpa"),
    )
    ins = [t.detach().float() for t in inputs(5)]
    calls = []
    for built, wide in ((True, True), (True, False), (False, False)):
        monkeypatch.setattr(dispatch, "c_tiles_built", lambda built=built: built)
        monkeypatch.setattr(dispatch, "c_tiles_wide", lambda wide=wide: wide)
        for caps in (torch.tensor([math.inf, 64.0, 64.0]), CAPS.float()):
            with torch.no_grad():  # a fixed prior: torch's fused attention's case
                got = dispatch.attention(*ins[:3], options(ins, ssmax_before_prior=True, ssmax_key_cap=caps))
            calls.append((got, caps))
    for got, caps in calls:
        want = bam_attention(*ins[:3], options(ins, ssmax_before_prior=True, ssmax_key_cap=caps))
        torch.testing.assert_close(got, want)
    # per setting: cap 64 > N (the op the call would take anyway), then caps reached
    assert ran == ["c_tiles", "c_tiles", "sdpa", "c_tiles", "sdpa", "reference"]


def test_options_refuse_a_cap_without_ssmax():
    with pytest.raises(ValueError, match="ssmax_key_cap caps SSMax's key count: it needs ssmax_s"):
        AttentionOptions(ssmax_key_cap=CAPS)


def first_attention(overrides) -> Attention:
    torch.manual_seed(0)
    return next(m for m in Decoder(load_config(CONFIG, overrides).model).modules() if isinstance(m, Attention))


def test_the_model_caps_the_heads_whose_prior_decays():
    """θ_β > 0 heads get the cap (ALiBi's every head), flat or inverted ones (θ_β <= 0) none; there is
    none without a prior or without SSMax (the configs' cap then stays as it is, idle: an arm that turns
    SSMax off needs no other change)."""
    cap = ["model.attention.ssmax_key_cap=256"]
    spread = first_attention([*cap, "model.attention.bam.init=spread"])
    caps, beta = spread._options(SequenceInfo(), 257).ssmax_key_cap, spread.prior()[1]
    assert bool((beta > 0).any()) and bool((beta <= 0).any())
    assert torch.equal(caps, torch.where(beta > 0, 256.0, math.inf))
    alibi = first_attention([*cap, "model.attention.positional=alibi"])
    assert torch.equal(alibi._options(SequenceInfo(), 257).ssmax_key_cap, torch.full((alibi.n_heads,), 256.0))
    assert (
        first_attention([*cap, "model.attention.positional=nope"])._options(SequenceInfo(), 257).ssmax_key_cap is None
    )
    assert first_attention([*cap, "model.attention.ssmax=false"])._options(SequenceInfo(), 257).ssmax_key_cap is None
    assert spread._options(SequenceInfo(), 256).ssmax_key_cap is None  # a call no row of which reaches the cap


def test_a_cap_of_seq_len_follows_the_training_length():
    for seq_len in (256, 1024):
        cfg = load_config(CONFIG, ["model.attention.ssmax_key_cap=seq_len", f"data.seq_len={seq_len}"])
        assert cfg.model.attention.ssmax_key_cap == seq_len and cfg.model.swa.ssmax_key_cap is None


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.attention.ssmax_key_cap=100"],
        ["model.attention.ssmax_key_cap=longest"],
    ],
)
def test_config_refuses_a_cap_training_would_reach(overrides):
    with pytest.raises(ConfigError, match="model.attention.ssmax_key_cap"):
        load_config(CONFIG, overrides)


def test_streamed_model_equals_its_one_shot_forward_past_the_cap():
    """A model trained at 16 tokens with the cap at 16, read past it: the prompt streamed in chunks (the
    dense ops, as `megabam eval` reads it) and in one forward (the dispatch: the tiled op) agree, and
    differ from the same weights without the cap."""
    small = ["model.vocab_size=97", "model.d_model=32", "model.n_layers=2", "model.n_heads=4"]
    small += ["model.attention.bam.init=spread", "data.seq_len=16", "data.passkey_min_tokens=null"]
    torch.manual_seed(0)
    capped = Decoder(load_config(CONFIG, [*small, "model.attention.ssmax_key_cap=16"]).model).double().eval()
    plain = Decoder(load_config(CONFIG, [*small, "model.attention.ssmax_key_cap=null"]).model).double().eval()
    plain.load_state_dict(capped.state_dict())
    ids = torch.randint(0, 97, (1, 53), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = capped(ids)[0]
        assert (logits - plain(ids)[0]).abs().max() > 1e-3
        # Rows up to the cap are those of the model without it (other ops, so to rounding).
        torch.testing.assert_close(logits[:16], plain(ids)[0][:16], rtol=0, atol=1e-12)
    losses = -torch.log_softmax(logits, -1)[torch.arange(52), ids[0, 1:]]
    for chunk in (7, 53):
        assert torch.equal(predict_next(capped, ids, chunk), logits.argmax(-1)[None])
        torch.testing.assert_close(token_losses(capped, ids, chunk), losses, rtol=0, atol=1e-10)
