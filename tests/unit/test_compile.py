"""train.compile=blocks (megabam/parallel/compile.py): compiled blocks train as the eager model does,
under every recompute mode, and a new sliding window per step recompiles nothing. On CPU, with
inductor, on one sliding-window layer: inductor's first build on a machine costs ~10 s (it probes
the vector ISAs), each graph ~1 s more, and an mLSTM layer, whose cell is left out of the graphs as
attention is, would add 3 graphs."""

import pytest
import torch

from megabam.config import ConfigError, load_config
from megabam.kernels import cpu_fused
from megabam.model import Decoder
from megabam.parallel.activation_checkpoint import apply_ac
from megabam.parallel.compile import apply_compile

CONFIG = [
    "model.vocab_size=97",
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.layer_pattern=[S]",
    "model.swa.block_size=8",
    "data.seq_len=32",
    "window.windows=[8, 16]",
]
WINDOWS = [8, 16, 8]  # one per step, as SWAX's sampler draws them
MIXERS = ["swa"]
C_RMS_NORM = cpu_fused.rms_norm


def _train(compile_mode: str, recompute: str) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Losses and gradients of SGD steps at WINDOWS (SGD: AdamW would turn rounding differences of
    gradients near 0 into whole steps), the model built and wrapped in megabam/parallel/parallelize.py's
    order; any recompilation after the first step raises."""
    import torch._dynamo

    torch.manual_seed(0)
    model = Decoder(load_config(None, CONFIG).model)
    apply_compile(model, compile_mode)
    apply_ac(model, recompute, MIXERS)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 33), generator=g)
    losses, grads = [], []
    for step, window in enumerate(WINDOWS):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            loss = model(ids[:, :-1], ids[:, 1:], window=window)
            loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def test_compiled_blocks_train_as_eager_and_new_windows_recompile_nothing(monkeypatch):
    """Every recompute mode in one test: they share the compiled code, built once. That the block ran
    compiled shows in the C RMS norm (kernels/cpu_fused.py): eagerly each block calls it twice, inside
    a graph the norm is inductor's, so it runs for the final norm alone, outside the blocks.

    torch._dynamo is imported here, not at the top: it imports Triton, and a Triton imported before
    the interpreter's test files set TRITON_INTERPRET=1 (when pytest collects them) breaks them."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    c_norms = []
    monkeypatch.setattr(cpu_fused, "rms_norm", lambda *args: c_norms.append(1) or C_RMS_NORM(*args))
    torch._dynamo.reset()
    counters.clear()
    for recompute in ("none", "full", "selective"):
        c_norms.clear()
        eager_losses, eager_grads = _train("off", recompute)
        assert len(c_norms) >= 3 * len(WINDOWS)  # two in the block and the final one, each step
        c_norms.clear()
        losses, grads = _train("blocks", recompute)
        assert len(c_norms) == len(WINDOWS), recompute
        torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=0, msg=recompute)
        for step, (mine, eager) in enumerate(zip(grads, eager_grads)):
            assert mine.keys() == eager.keys()  # compiled in place: the checkpoint's names
            for name, g in mine.items():
                where = f"{recompute}, step {step}: {name}"
                torch.testing.assert_close(g, eager[name], rtol=1e-5, atol=1e-7, msg=where)
    # The graphs were made (by the first mode; the others reuse them), and the only breaks between
    # them are the kernels' calls.
    assert counters["stats"]["unique_graphs"] > 0
    assert counters["graph_break"] and all("torch.compiler.disable" in why for why in counters["graph_break"])
    torch._dynamo.reset()


def test_compile_modes_load_and_an_unknown_one_is_a_one_line_error_naming_the_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  compile: off\n")  # YAML reads a bare off as false
    assert load_config(path).train.compile == "off"
    assert load_config(None, ["train.compile=blocks"]).train.compile == "blocks"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.compile=model"])
    assert err.value.key == "train.compile" and "\n" not in str(err.value)
    assert "'model' is not one of off, blocks" in str(err.value)
