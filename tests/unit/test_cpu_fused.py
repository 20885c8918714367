"""The one-pass C forms of RMS normalisation, the SwiGLU product and the rotary embedding
(kernels/cpu_fused.py) against their PyTorch forms (megabam/model/layers.py, positional.py, mode
reference) in float64 and fp32, values and gradients; and where kernels/dispatch.py runs them: CPU
fp32/fp64 in mode auto, the PyTorch form otherwise (mode reference, bf16, per-head norm weights, a
library that does not build)."""

import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import megabam.kernels.cpu_fused as fused
from megabam.config import load_config
from megabam.kernels import cpu_build, dispatch
from megabam.model import Decoder
from megabam.model.layers import SwiGLU, head_rms_norm, rms_norm
from megabam.model.positional import apply_rope, rope_rotation

TINY = Path(__file__).resolve().parents[2] / "yaml_configs" / "tiny_cpu.yaml"


@pytest.fixture(autouse=True)
def built():
    assert fused.library() is not None, "the fused ops did not build (see the warning logged)"


def _norm_case(dtype, shape=(3, 37, 96), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(*shape, generator=g, dtype=dtype)).requires_grad_()
    w = torch.randn(shape[-1], generator=g, dtype=dtype).requires_grad_()
    return x, w, torch.randn(*shape, generator=g, dtype=dtype)


def _results(f, inputs, dy):
    out = f(*inputs)
    return [out, *torch.autograd.grad(out, inputs, dy)]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_rms_norm_matches_the_pytorch_form(dtype, tol):
    x, w, dy = _norm_case(dtype)
    got = _results(lambda x, w: fused.rms_norm(x, w, 1e-5), (x, w), dy)
    want = _results(lambda x, w: rms_norm(x, w, 1e-5, "reference"), (x, w), dy)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=tol, atol=tol * b.abs().max().item())


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_swiglu_matches_the_pytorch_form_saturated_gates_too(dtype, tol):
    g = torch.Generator().manual_seed(1)
    gate_up = 4 * torch.randn(5, 29, 2 * 40, generator=g, dtype=dtype)
    gate_up[0, 0, :4] = torch.tensor([-1000.0, -90.0, 90.0, 1000.0])  # beyond exp's range either way
    gate_up.requires_grad_()
    dy = torch.randn(5, 29, 40, generator=g, dtype=dtype)

    def reference(gu):
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up

    got = _results(fused.swiglu, (gate_up,), dy)
    want = _results(reference, (gate_up,), dy)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        assert torch.allclose(a, b, rtol=tol, atol=tol * b.abs().max().item())


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_rope_matches_the_pytorch_form_on_the_fused_projections_view(dtype, tol):
    """q and k as attention._project hands them over: the first 2·H heads of the [q | k | v] projection,
    rows 3·H·D apart; positions continuing a stream (start > 0) too."""
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(3, 21, 3 * 4, 16, generator=g, dtype=dtype)
    qk = qkv[:, :, :8].requires_grad_()  # a view: not contiguous
    dy = torch.randn(3, 21, 8, 16, generator=g, dtype=dtype)
    for start in (0, 5):
        rotation = rope_rotation(21, 16, 10000.0, start=start)
        got = _results(lambda x: fused.rope(x, rotation), (qk,), dy)
        want = _results(lambda x: apply_rope(x, rotation, "reference"), (qk,), dy)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=tol, atol=tol * b.abs().max().item())


def test_gradcheck_and_strided_inputs():
    x, w, _ = _norm_case(torch.float64, (2, 5, 8))
    assert torch.autograd.gradcheck(lambda x, w: fused.rms_norm(x, w, 1e-5), (x, w))
    gate_up = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fused.swiglu, (gate_up,))
    rotation = rope_rotation(5, 4, 10000.0)
    assert torch.autograd.gradcheck(lambda x: fused.rope(x, rotation), (gate_up.view(2, 5, 3, 4),))
    wide = torch.randn(4, 7, 2 * 96, dtype=torch.float64)
    strided, w = wide[..., ::2], torch.randn(96, dtype=torch.float64)  # every other column: not contiguous
    assert torch.allclose(fused.rms_norm(strided, w, 1e-5), rms_norm(strided, w, 1e-5, "reference"))
    gate, up = wide.transpose(0, 1).chunk(2, dim=-1)  # a transposed view: not contiguous
    assert torch.allclose(fused.swiglu(wide.transpose(0, 1)), F.silu(gate) * up)


def test_results_do_not_depend_on_the_thread_count():
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            x, w, dy = _norm_case(torch.float32, (2, 300, 64))  # 600 rows: 10 blocks of the weight gradient
            gate_up = torch.randn(600, 2 * 48, generator=torch.Generator().manual_seed(2), requires_grad=True)
            out = fused.swiglu(gate_up)
            results.append(
                _results(lambda x, w: fused.rms_norm(x, w, 1e-5), (x, w), dy)
                + [out, *torch.autograd.grad(out, gate_up, torch.ones_like(out))]
            )
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _ran(monkeypatch) -> list:
    """Which calls of rms_norm, swiglu and rope took the C forms (one "c_fused" each)."""
    ran = []
    for name in ("rms_norm", "swiglu", "rope"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _real=real, **k: ran.append("c_fused") or _real(*a, **k))
    monkeypatch.setattr(dispatch, "logged_choices", set())
    monkeypatch.delenv(dispatch.ENV, raising=False)
    return ran


def test_dispatch_runs_the_c_forms_on_cpu_fp32_and_fp64_in_mode_auto(monkeypatch, caplog):
    ran = _ran(monkeypatch)
    mlp = SwiGLU(16, 24)
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        for dtype in (torch.float32, torch.float64):
            x = torch.randn(2, 5, 16, dtype=dtype)
            rms_norm(x, torch.ones(16, dtype=dtype), 1e-5)
            mlp.to(dtype)(x)
            apply_rope(x.view(2, 5, 2, 8), rope_rotation(5, 8, 10000.0))
    assert ran == ["c_fused"] * 6
    assert caplog.text.count("rms_norm op: c_fused (mode auto, cpu tensors)") == 1  # logged once
    assert caplog.text.count("swiglu op: c_fused (mode auto, cpu tensors)") == 1


def test_dispatch_keeps_the_pytorch_forms_elsewhere(monkeypatch):
    ran = _ran(monkeypatch)
    x = torch.randn(2, 5, 16)
    rms_norm(x, torch.ones(16), 1e-5, "reference")  # mode reference: the oracle
    rms_norm(x, torch.ones(16), 1e-5, "triton")  # no Triton kernel for norms: the PyTorch form
    rms_norm(x.bfloat16(), torch.ones(16, dtype=torch.bfloat16), 1e-5)  # bf16
    rms_norm(x, torch.ones(16, dtype=torch.float64), 1e-5)  # mixed dtypes
    head_rms_norm(x.view(2, 1, 5, 16), torch.ones(16), 1e-5)  # a per-head weight
    SwiGLU(16, 24, backend="reference")(x)
    apply_rope(x.view(2, 5, 2, 8), rope_rotation(5, 8, 10000.0), "reference")
    monkeypatch.setenv(dispatch.ENV, "reference")  # the environment wins over the config
    SwiGLU(16, 24)(x)
    assert ran == []
    monkeypatch.setenv(dispatch.ENV, "fast")
    with pytest.raises(ValueError, match="MEGABAM_KERNELS must be one of auto, triton, reference, got 'fast'"):
        rms_norm(x, torch.ones(16), 1e-5)


def test_a_failed_build_falls_back_to_the_pytorch_forms(tmp_path, monkeypatch, caplog):
    ran = _ran(monkeypatch)
    monkeypatch.setenv("MEGABAM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    fused.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
            assert fused.library() is None
            y = rms_norm(torch.randn(3, 8), torch.ones(8), 1e-5)
        assert "fused CPU norm, MLP and rotary ops unavailable" in caplog.text and "false" in caplog.text
        assert ran == [] and y.shape == (3, 8)
    finally:
        fused.library.cache_clear()  # the next test loads from the real cache again
    assert shutil.which("cc") or shutil.which("gcc")


@pytest.mark.parametrize("positional", ["ggd_bam", "rope"])
def test_decoder_trains_alike_on_both_forms(monkeypatch, positional):
    """A whole model (tiny_cpu's, narrower; GGD-BAM + SSMax or RoPE) in float64: loss and every gradient
    of mode auto (the C forms and the C attention kernel) equal mode reference (PyTorch everywhere)."""
    ran, results = _ran(monkeypatch), []
    for mode in ("auto", "reference"):
        overrides = ["model.d_model=32", "model.n_layers=2", f"model.kernels={mode}"]
        cfg = load_config(TINY, [*overrides, f"model.attention.positional={positional}"])
        torch.manual_seed(0)
        model = Decoder(cfg.model).double()
        ids = torch.randint(0, cfg.model.vocab_size, (2, 65), generator=torch.Generator().manual_seed(3))
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    # mode auto: 2 norms and an MLP per layer (and the rotation under RoPE), the final norm
    assert ran == ["c_fused"] * (9 if positional == "rope" else 7)
    attention = {choice for op, mode, choice, _ in dispatch.logged_choices if op == "attention" and mode == "auto"}
    assert attention == {"c_tiles"}
    for a, b in zip(*results):
        assert (a is None) == (b is None)  # parameters without a gradient (θ_μ here) on both
        if b is not None:
            assert (a - b).abs().max() <= 1e-10 * b.abs().max()
