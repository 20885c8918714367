"""The decoder and its positional schemes, against independent formulas and invariances."""

import math

import pytest
import torch

from megabam.config import load_config
from megabam.model import Decoder
from megabam.model.positional import alibi_slopes, apply_rope, rope_rotation, sinusoidal_table

V = 97


def _model(*overrides, seed=0):
    cfg = load_config(
        None,
        [
            f"model.vocab_size={V}",
            "model.d_model=32",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.attention.block_size=8",
            *overrides,
        ],
    )
    torch.manual_seed(seed)
    return Decoder(cfg.model).double()


@pytest.mark.parametrize("positional", ["ggd_bam", "alibi", "nope", "rope", "sinusoidal"])
@pytest.mark.parametrize("ssmax", [True, False])
def test_every_scheme_trains_finite_from_uniform_loss(positional, ssmax):
    model = _model(f"model.attention.positional={positional}", f"model.attention.ssmax={str(ssmax).lower()}")
    ids, labels = torch.randint(0, V, (2, 21)), torch.randint(0, V, (2, 21))
    loss = model(ids, labels)
    assert abs(loss.item() - math.log(V)) < 0.1  # small init: near-uniform predictions
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_ssmax_s_and_weights_start_where_the_config_says():
    model = _model("model.attention.ssmax_init=0.25", "model.init_std=0.1", "model.n_layers=4")
    assert all(torch.equal(b.mixer.ssmax_s, torch.full((4,), 0.25, dtype=torch.float64)) for b in model.blocks)
    assert abs(model.blocks[0].mixer.qkv.weight.std().item() - 0.1) < 0.01
    residual = 0.1 / math.sqrt(2 * 4)  # output projections shrunk with depth
    assert abs(model.blocks[0].mixer.out.weight.std().item() - residual) < 0.005


def test_alibi_slopes_match_the_paper():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(h + 1) for h in range(8)]))
    assert torch.allclose(alibi_slopes(4), torch.tensor([2.0 ** (-2 * (h + 1)) for h in range(4)]))
    assert alibi_slopes(6).shape == (6,)


@pytest.mark.parametrize("init", ["alibi", "nope", "spread", "mixed"])
def test_prior_init_modes(init):
    model = _model(
        f"model.attention.bam.init={init}",
        "model.attention.bam.beta_range=[-1.0, 2.0]",
        "model.attention.bam.flat_fraction=0.5",
    )
    prior = model.blocks[0].mixer.prior
    slopes = torch.tensor([2.0 ** (-2 * (h + 1)) for h in range(4)], dtype=torch.float64)
    expected = {
        "alibi": (slopes.log(), torch.ones(4)),
        "nope": (torch.zeros(4), torch.zeros(4)),
        "spread": (slopes.log(), torch.tensor([-1.0, 0.0, 1.0, 2.0])),
        "mixed": (torch.cat([slopes[:2].log(), torch.zeros(2)]), torch.tensor([1.0, 1.0, 0.0, 0.0])),
    }[init]
    assert torch.allclose(prior.theta_alpha, expected[0].double())
    assert torch.allclose(prior.theta_beta, expected[1].double())
    assert not prior.theta_mu.requires_grad


@pytest.mark.parametrize("other,init", [("alibi", "alibi"), ("nope", "nope")])
def test_bam_reduces_to_alibi_and_nope(other, init):
    """GGD-BAM at β=1 is ALiBi with slope exp(θ_α); at β=0 it is a constant bias, i.e. NoPE."""
    bam = _model("model.attention.positional=ggd_bam", f"model.attention.bam.init={init}")
    ref = _model(f"model.attention.positional={other}")
    ref.load_state_dict(bam.state_dict(), strict=False)
    ids = torch.randint(0, V, (2, 19))
    torch.testing.assert_close(bam(ids), ref(ids), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("positional", ["ggd_bam", "alibi", "nope"])
def test_document_aware_attention_isolates_documents(positional):
    """With packed documents, the second document's logits equal those of that document alone:
    no attention across the boundary, and SSMax counts n_i from the document start."""
    model = _model(f"model.attention.positional={positional}", "model.attention.bam.init=spread")
    first, second = torch.randint(0, V, (1, 11)), torch.randint(0, V, (1, 14))
    packed = torch.cat([first, second], dim=1)
    doc_ids = torch.tensor([[0] * 11 + [1] * 14])
    torch.testing.assert_close(model(packed, doc_ids=doc_ids)[:, 11:], model(second), rtol=1e-10, atol=1e-10)
    # and the switch matters: without document ids the second document sees the first
    assert not torch.allclose(model(packed)[:, 11:], model(second))


def test_rope_rotates_each_pair_by_its_angle():
    """Written out with cos and sin per pair, in float64: x (B, N, heads, D)."""
    x = torch.randn(2, 10, 3, 8, dtype=torch.float64)
    pos = torch.arange(10, dtype=torch.float64)[:, None, None]
    angle = pos * 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)  # (N, 1, D/2)
    even, odd = x[..., 0::2], x[..., 1::2]
    want = torch.stack([even * angle.cos() - odd * angle.sin(), even * angle.sin() + odd * angle.cos()], dim=-1)
    got = apply_rope(x, rope_rotation(10, 8, 10000.0))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want.flatten(-2), rtol=1e-6, atol=1e-6)  # the angles are fp32
    # a stream continued at position 4 rotates as the whole sequence's positions 4..
    torch.testing.assert_close(apply_rope(x[:, 4:], rope_rotation(6, 8, 10000.0, start=4)), got[:, 4:])


def test_sinusoidal_table_formula():
    table = sinusoidal_table(6, 8)
    for pos in range(6):
        for i in range(4):
            angle = pos / 10000 ** (2 * i / 8)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_soft_capped_logits_and_their_loss_match_float64_math():
    """model.logit_soft_cap: every logit is cap·tanh(z/cap) of the uncapped model's z, and the loss (with
    its gradient) is the cross-entropy of those, written out by hand (the loss itself runs in fp32)."""
    capped, plain = _model("model.logit_soft_cap=2.5"), _model()
    plain.load_state_dict(capped.state_dict())
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    labels, z = ids.roll(-1, 1), plain(ids)
    expected_logits = 2.5 * torch.tanh(z / 2.5)
    assert torch.allclose(capped(ids), expected_logits, rtol=0, atol=1e-12)
    log_p = expected_logits - expected_logits.exp().sum(-1, keepdim=True).log()
    expected = -log_p.gather(-1, labels[..., None]).mean()
    loss = capped(ids, labels)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    expected.backward()
    for (name, a), b in zip(capped.named_parameters(), plain.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        assert a.grad is None or torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7), name


def test_tied_and_untied_embeddings():
    tied, untied = _model(), _model("model.tie_embeddings=false")
    assert tied.lm_head is None and untied.lm_head is not None
    assert untied.num_params() - tied.num_params() == V * 32


def test_layer_pattern_repeats():
    model = _model("model.n_layers=4", "model.layer_pattern=[attention, attention]")
    assert len(model.blocks) == 4


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_attention_equals_full_attention_with_shared_kv_weights(kv_heads):
    """A GQA model is the multi-head model whose key and value projections repeat each kv head's
    weights for the query heads of its group: same logits and loss, and the GQA model's kv
    gradients are the sums of the multi-head model's over each group."""
    gqa = _model(f"model.attention.kv_heads={kv_heads}", "model.attention.bam.init=spread", seed=3)
    full = _model("model.attention.bam.init=spread", seed=3)
    group, D = 4 // kv_heads, 32 // 4
    with torch.no_grad():
        for name, p in full.named_parameters():
            source = dict(gqa.named_parameters())[name]
            if not name.endswith("qkv.weight"):
                p.copy_(source)
                continue
            q, k, v = source.split([32, kv_heads * D, kv_heads * D])
            repeat = lambda w: w.view(kv_heads, D, 32).repeat_interleave(group, 0).reshape(32, 32)  # noqa: E731
            p.copy_(torch.cat([q, repeat(k), repeat(v)]))
    assert gqa.blocks[0].mixer.qkv.weight.shape == ((4 + 2 * kv_heads) * D, 32)
    ids, labels = torch.randint(0, V, (2, 2, 24), generator=torch.Generator().manual_seed(0))
    doc_ids = (torch.arange(24) >= 10).long().expand(2, 24)
    torch.testing.assert_close(gqa(ids, doc_ids=doc_ids), full(ids, doc_ids=doc_ids), rtol=1e-10, atol=1e-10)
    gqa(ids, labels, doc_ids).backward()
    full(ids, labels, doc_ids).backward()
    got = gqa.blocks[0].mixer.qkv.weight.grad.split([32, kv_heads * D, kv_heads * D])
    want = full.blocks[0].mixer.qkv.weight.grad.split([32, 32, 32])
    torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-12)
    for g, w in zip(got[1:], want[1:]):
        summed = w.view(kv_heads, group, D, 32).sum(1).reshape(kv_heads * D, 32)
        torch.testing.assert_close(g, summed, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.attention.positional=sinusoidal"],  # full attention asks for them
        ["model.layer_pattern=[SM]", "model.attention.positional=sinusoidal"],  # asked by a section not in use
        ["model.layer_pattern=[SM]", "model.swa.positional=sinusoidal"],
        ["model.layer_pattern=[AM]", "model.swa.positional=sinusoidal"],
        [],
    ],
)
def test_the_config_says_whether_the_embeddings_get_sinusoidal_positions(overrides):
    """The decoder asks its config; what the built layers' own settings say is the reference."""
    small = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.swa.window=64", "window.windows=[64]"]
    cfg = load_config(None, [*small, "window.probabilities=[1.0]", *overrides]).model
    model = Decoder(cfg)
    asked = any(getattr(block.mixer, "positional", None) == "sinusoidal" for block in model.blocks)
    assert cfg.sinusoidal_positions() == model.sinusoidal == asked
