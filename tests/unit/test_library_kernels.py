"""The field's recurrent kernels megabam runs on CUDA, against megabam's float64 loops: Gated DeltaNet
on flash-linear-attention (kernels/gated_deltanet_fla.py) and the mLSTM on NX-AI's TFLA
(kernels/mlstm_tfla.py), and the dispatch that picks them.

fla's Triton kernels run here under the interpreter (TRITON_INTERPRET=1, set before fla is imported;
tests/helpers/triton_interpreter.py says what else they need): forward, every gradient and the final
state are checked. TFLA's cannot (Triton 3.9 removed the block pointers they use): its mapping is
checked through the library's own PyTorch forms, which take the kernels' arguments and compute the
same function; tools/gpu_check.sh runs the kernels themselves against the reference first thing.
"""

import logging
import os

os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from helpers.triton_interpreter import run_library_under_interpreter  # noqa: E402

from megabam.config import load_config  # noqa: E402
from megabam.kernels import dispatch, gated_deltanet_fla, mlstm_tfla  # noqa: E402
from megabam.kernels.gated_deltanet import gated_delta_recurrent  # noqa: E402
from megabam.kernels.mlstm import MLstmState, mlstm_chunkwise, mlstm_step  # noqa: E402
from megabam.model.gated_deltanet import GatedDeltaNet  # noqa: E402
from megabam.model.layers import SequenceInfo  # noqa: E402

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("fla") is None or importlib.util.find_spec("mlstm_kernels") is None,
    reason="the gpu extra (fla-core, mlstm-kernels) is not installed",
)


@pytest.fixture
def fla(monkeypatch):
    importlib.import_module(gated_deltanet_fla.FLA_OPS)
    run_library_under_interpreter(monkeypatch, "fla")
    monkeypatch.setattr(dispatch, "logged_choices", set())
    monkeypatch.delenv(dispatch.ENV, raising=False)


def _gdn_inputs(n=40, dk=16, dv=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(1, 2, n, dk, generator=g, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(1, 2, n, dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(1, 2, n, generator=g, dtype=torch.float64)
    beta = torch.rand(1, 2, n, generator=g, dtype=torch.float64)
    S0 = 0.3 * torch.randn(1, 2, dk, dv, generator=g, dtype=torch.float64)
    return [q, k, v, decay, beta, S0]


def _value_and_grads(op, inputs, seed=1):
    """op's (o, S) and the gradients of Σ o·do + Σ S·dS with respect to every input."""
    inputs = [t.detach().requires_grad_() for t in inputs]
    o, S = op(*inputs)
    g = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum()
    loss = loss + (S * torch.randn(S.shape, generator=g, dtype=torch.float64).to(S.dtype)).sum()
    return [o, S, *torch.autograd.grad(loss, inputs)]


def test_fla_chunk_kernels_equal_the_float64_loop(fla):
    """fla's chunkwise kernels through megabam's arguments (40 steps: a partial chunk, an incoming
    state): output, final state and the gradients of q, k, v, g, β and the incoming state. (With
    fla's in-kernel L2 norm on, dq and dk would take its Jacobian: this test fails.)"""
    inputs = _gdn_inputs()
    want = _value_and_grads(gated_delta_recurrent, inputs)
    got = _value_and_grads(gated_deltanet_fla.gated_delta_chunkwise_fla, [t.float() for t in inputs])
    names = ["o", "S", "dq", "dk", "dv", "dg", "dbeta", "dS0"]
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=name)


def test_fla_recurrent_kernel_equals_the_float64_loop(fla):
    """fla's fused recurrent kernel (generation; forward only) over a few steps from a state."""
    q, k, v, decay, beta, S0 = _gdn_inputs(n=3)
    want = gated_delta_recurrent(q, k, v, decay, beta, S0)
    got = gated_deltanet_fla.gated_delta_recurrent_fla(*(t.float() for t in (q, k, v, decay, beta, S0)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_gated_deltanet_layer_on_fla_equals_its_reference(fla):
    """The mixer with model.kernels = triton (fla's kernels) equals it with reference, output and
    weight gradients, over a chunk, one step (with gradients: the chunk kernel) and a chunk carried
    through the state: layouts, scale, gate dtypes and the state's layout mapped."""
    torch.manual_seed(0)
    overrides = ["model.d_model=32", "model.n_heads=2", "model.gated_deltanet.chunk_size=8"]
    layers = {}
    for mode in ("triton", "reference"):
        torch.manual_seed(0)
        layers[mode] = GatedDeltaNet(load_config(None, [*overrides, f"model.kernels={mode}"]).model)
    x = torch.randn(1, 25, 32)
    results = {}
    for mode, layer in layers.items():
        state, outs = None, []
        for part in (x[:, :12], x[:, 12:13], x[:, 13:]):
            out, state = layer.stream(part, state, SequenceInfo())
            outs.append(out)
        out = torch.cat(outs, dim=1)
        grads = torch.autograd.grad(out.square().sum(), [p for p in layer.parameters()])
        results[mode] = [out, state.S, *grads]
    for a, b in zip(results["triton"], results["reference"]):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)


@pytest.fixture
def tfla_torch_forms(monkeypatch):
    """mlstm_tfla's calls go to the library's PyTorch forms (the kernels' signatures and function;
    they want one dtype where the kernels take bf16 q, k, v beside fp32 gates: q, k, v are cast)."""
    forms = {
        mlstm_tfla.CHUNKWISE: ("mlstm_kernels.torch.chunkwise.native", "mlstm_chunkwise__native_autograd"),
        mlstm_tfla.STEP: ("mlstm_kernels.torch.recurrent.native_step", "mlstm_recurrent_step__native"),
    }

    def library(name):
        form = getattr(importlib.import_module(forms[name][0]), forms[name][1])

        def call(q, k, v, i, *args, **kwargs):
            return form(*(t.to(i.dtype) for t in (q, k, v)), i, *args, **kwargs)

        return call

    monkeypatch.setattr(mlstm_tfla, "_library", library)


def _mlstm_inputs(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, n, 32, generator=g, dtype=torch.float64)
    i, f = (
        3 * torch.randn(1, 2, n, generator=g, dtype=torch.float64),
        3 + 2 * torch.randn(1, 2, n, generator=g, dtype=torch.float64),
    )
    return q, k, v, i, f


def _unscaled(state: MLstmState) -> tuple:
    """The state as the sums it stands for (C and n are kept scaled by exp(-m))."""
    scale = torch.exp(state.m)
    return state.C * scale[..., None, None], state.n * scale[..., None]


def test_tfla_mapping_equals_the_float64_reference(tfla_torch_forms):
    """40 steps with chunk 16 (padded to 48), from the empty state and then from the state reached:
    h within the eps term of the empty state's start (at most eps relative, module docstring), the
    state as the same sums, and every input's gradient."""
    eps = 1e-6
    q, k, v, i, f = _mlstm_inputs()
    leaves = [t.requires_grad_() for t in (q, k, v, i, f)]
    want, want_state = mlstm_chunkwise(q, k, v, i, f, eps, 16)
    got, got_state = mlstm_tfla.mlstm_chunkwise_tfla(q, k, v, i, f, eps, 16)
    assert got.shape == want.shape and got_state.m.shape == want_state.m.shape
    torch.testing.assert_close(got, want, rtol=10 * eps, atol=10 * eps)
    for a, b in zip(_unscaled(got_state), _unscaled(want_state)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    do = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((got * do).sum(), leaves), torch.autograd.grad((want * do).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    more = _mlstm_inputs(n=21, seed=1)
    got2, got2_state = mlstm_tfla.mlstm_chunkwise_tfla(*more, eps, 16, want_state)
    want2, want2_state = mlstm_chunkwise(*more, eps, 16, want_state)
    torch.testing.assert_close(got2, want2, rtol=1e-10, atol=1e-10)
    for a, b in zip(got2_state, want2_state):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_tfla_step_mapping_equals_megabam_step(tfla_torch_forms):
    q, k, v, i, f = (t[..., 0, :] if t.dim() == 4 else t[..., 0] for t in _mlstm_inputs(n=1))
    state = mlstm_chunkwise(*_mlstm_inputs(n=20, seed=2), 1e-6, 8)[1]
    h, new = mlstm_tfla.mlstm_step_tfla(q, k, v, i, f, 1e-6, state)
    want_h, want_new = mlstm_step(q, k, v, i, f, 1e-6, state)
    torch.testing.assert_close(h, want_h, rtol=1e-12, atol=1e-12)
    for a, b in zip(new, want_new):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_tfla_is_unusable_on_a_triton_without_block_pointers():
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 9):
        assert not mlstm_tfla.usable()


def test_cuda_dispatch_picks_the_libraries_and_warns_once_without_them(monkeypatch, caplog):
    """On CUDA in mode auto: fla for Gated DeltaNet, TFLA for the mLSTM (chunkwise and steps); without
    them the reference and megabam's own kernel, each with one warning naming the extra."""
    monkeypatch.setattr(dispatch, "on_cuda", lambda tensor: True)
    monkeypatch.setattr(dispatch, "logged_choices", set())
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setattr(mlstm_tfla, "usable", lambda: True)
    assert dispatch.cuda_gated_delta_choice()[0] == "fla"
    assert dispatch.cuda_mlstm_choice()[0] == "tfla"
    monkeypatch.setattr(mlstm_tfla, "usable", lambda: False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "fla" else real_find_spec(name, *a)
    )
    with caplog.at_level(logging.WARNING, logger=dispatch.log.name):
        choices = [dispatch.cuda_gated_delta_choice()[0], dispatch.cuda_mlstm_choice()[0]] * 2
    assert choices == ["reference", "triton"] * 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("megabam[gpu]" in w for w in warnings), warnings


def test_mixers_reach_the_library_ops(monkeypatch, tfla_torch_forms, fla):
    """The mLSTM's chunkwise and step calls and Gated DeltaNet's chunk and step calls land on the
    library ops on (stand-in) CUDA tensors, the latter with q, k, v in the model's dtype."""
    ran = []
    for module, name in [
        (mlstm_tfla, "mlstm_chunkwise_tfla"),
        (mlstm_tfla, "mlstm_step_tfla"),
        (gated_deltanet_fla, "gated_delta_chunkwise_fla"),
        (gated_deltanet_fla, "gated_delta_recurrent_fla"),
    ]:
        real = getattr(module, name)

        def op(*args, _name=name, _real=real):
            ran.append((_name, args[0].dtype))
            return _real(*args)

        monkeypatch.setattr(module, name, op)
    monkeypatch.setattr(dispatch, "on_cuda", lambda tensor: True)
    monkeypatch.setattr(mlstm_tfla, "usable", lambda: True)
    from megabam.model.mlstm import MLstm

    cfg = load_config(None, ["model.d_model=32", "model.n_heads=2", "model.mlstm.chunk_size=8"]).model
    x = torch.randn(1, 10, 32).bfloat16()
    for layer in (MLstm(cfg).bfloat16(), GatedDeltaNet(cfg).bfloat16()):
        _, state = layer.stream(x, None, SequenceInfo())
        with torch.no_grad():  # generation (with gradients a step takes the chunk kernel, as above)
            layer.stream(x[:, :1], state, SequenceInfo())
    assert [name for name, _ in ran] == [
        "mlstm_chunkwise_tfla",
        "mlstm_step_tfla",
        "gated_delta_chunkwise_fla",
        "gated_delta_recurrent_fla",
    ]
    assert ran[0][1] == ran[2][1] == torch.bfloat16
