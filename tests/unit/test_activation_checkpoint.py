"""Activation recomputation changes memory, not results: losses and gradients equal the plain model's,
and the recomputed modules really run twice per step."""

import pytest
import torch

from megabam.config import ConfigError, load_config
from megabam.model import Decoder
from megabam.parallel.activation_checkpoint import apply_ac

BASE = [
    "model.vocab_size=97",
    "model.d_model=32",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.attention.block_size=8",
    "model.swa.block_size=8",
    "model.mlstm.chunk_size=8",
    "model.swa.window=8",
    "window.windows=[8]",
    "window.probabilities=[1.0]",
]


def _loss_and_grads(pattern, mode, mixers, counts):
    cfg = load_config(None, [*BASE, f"model.layer_pattern=[{pattern}]"])
    torch.manual_seed(0)
    model = Decoder(cfg.model).double()
    # Count calls of the first linear layer inside each mixer and MLP: recomputation re-runs a module's
    # forward without its own hooks, and stops early once every saved tensor is back, but the first
    # projection always runs again.
    for i, block in enumerate(model.blocks):
        for part in ("mixer", "mlp"):
            first = next(m for m in getattr(block, part).modules() if isinstance(m, torch.nn.Linear))
            first.register_forward_pre_hook(lambda *_, k=(part, i): counts.__setitem__(k, counts.get(k, 0) + 1))
    apply_ac(model, mode, mixers)
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(2))
    loss = model(ids, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pattern", ["A", "SM", "SG"])
@pytest.mark.parametrize(
    "mode,mixers", [("full", []), ("selective", ["attention", "swa"]), ("selective", ["mlstm", "gated_deltanet"])]
)
def test_recomputation_gives_the_same_loss_and_gradients(pattern, mode, mixers):
    plain_counts, counts = {}, {}
    loss_ref, grads_ref = _loss_and_grads(pattern, "none", [], plain_counts)
    loss, grads = _loss_and_grads(pattern, mode, mixers, counts)
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-12, atol=1e-12)
    # the recomputed modules ran twice (forward, then again in backward), the others once
    assert set(plain_counts.values()) == {1}
    model_types = Decoder(load_config(None, [*BASE, f"model.layer_pattern=[{pattern}]"]).model).layer_types
    for (part, i), n in counts.items():
        recomputed = mode == "full" or (part == "mixer" and model_types[i] in mixers)
        assert n == (2 if recomputed else 1), (part, i, n)


def test_unknown_recompute_mixer_is_refused():
    with pytest.raises(ConfigError, match=r"parallel\.recompute_mixers\[0\]: unknown mixer 'mamba'"):
        load_config(None, ["parallel.recompute=selective", "parallel.recompute_mixers=[mamba]"])
