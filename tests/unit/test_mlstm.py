"""mLSTM: parallel, chunkwise and recurrent forms against a float64 loop over time written from the
equations (methods.md §2), forward and gradients, for chunk sizes that do and do not divide the length
and for random, saturated and extreme gates. Tolerance 1e-9 (float64)."""

import math

import pytest
import torch

from megabam.config import ConfigError, load_config
from megabam.kernels.mlstm import mlstm_chunkwise, mlstm_parallel, mlstm_recurrent
from megabam.model.layers import SequenceInfo
from megabam.model.mlstm import MLstm

EPS = 1e-6
B, H, N, DQK, DV = 2, 3, 13, 4, 6


def reference(q, k, v, i, f, eps=EPS):
    """The cell equations as written, one time step at a time, batch and heads vectorised."""
    C = torch.zeros(B, H, DQK, DV, dtype=q.dtype)
    n = torch.zeros(B, H, DQK, dtype=q.dtype)
    m = torch.full((B, H), -math.inf, dtype=q.dtype)
    out = []
    for t in range(q.shape[2]):
        log_f = -torch.log1p(torch.exp(-f[:, :, t]))  # log sigmoid
        m_new = torch.maximum(log_f + m, i[:, :, t])
        a = torch.exp(log_f + m - m_new)
        b = torch.exp(i[:, :, t] - m_new)
        kt, vt = k[:, :, t], v[:, :, t]
        C = a[..., None, None] * C + b[..., None, None] * torch.einsum("bhd,bhe->bhde", kt, vt)
        n = a[..., None] * n + b[..., None] * kt
        qt = q[:, :, t] / math.sqrt(DQK)
        num = torch.einsum("bhd,bhde->bhe", qt, C)
        den = torch.maximum(torch.einsum("bhd,bhd->bh", qt, n).abs(), torch.exp(-m_new)) + eps
        out.append(num / den[..., None])
        m = m_new
    return torch.stack(out, dim=2)


def inputs(gates: str, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, DQK, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, N, DQK, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, N, DV, generator=g, dtype=torch.float64)
    i, f = torch.randn(2, B, H, N, generator=g, dtype=torch.float64)
    if gates == "random":
        i, f = 3 * i, 3 + 2 * f
    elif gates == "saturated":  # soft-capped pre-activations near ±15, either sign
        i, f = 15 * torch.tanh(10 * i), 15 * torch.tanh(10 * f)
    elif gates == "forgetful":  # forget gate ≈ 0 and tiny inputs: exp(-m) dominates the denominator
        i, f = -15 + 0.1 * i, -15 + 0.1 * f
    return [t.requires_grad_() for t in (q, k, v, i, f)]


def forms(chunk_size):
    return {
        "parallel": lambda *x: mlstm_parallel(*x, EPS),
        "chunkwise": lambda *x: mlstm_chunkwise(*x, EPS, chunk_size)[0],
        "recurrent": lambda *x: mlstm_recurrent(*x, EPS)[0],
    }


@pytest.mark.parametrize("gates", ["random", "saturated", "forgetful"])
@pytest.mark.parametrize("chunk_size", [1, 4, 5, 13, 32])  # 4, 5 do not divide 13; 32 > N
def test_forms_match_reference_forward_and_gradients(gates, chunk_size):
    x = inputs(gates)
    weight = torch.randn(B, H, N, DV, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    want = reference(*x)
    want_grads = torch.autograd.grad((want * weight).sum(), x)
    assert torch.isfinite(want).all()
    for name, form in forms(chunk_size).items():
        got = form(*x)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=name)
        for g, w in zip(torch.autograd.grad((got * weight).sum(), x), want_grads):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("split", [1, 6, 12])
def test_chunkwise_state_continues_a_sequence(split):
    q, k, v, i, f = (t.detach() for t in inputs("random", seed=3))
    whole, state_whole = mlstm_chunkwise(q, k, v, i, f, EPS, 4)
    first, state = mlstm_chunkwise(
        q[:, :, :split], k[:, :, :split], v[:, :, :split], i[:, :, :split], f[:, :, :split], EPS, 4
    )
    second, state = mlstm_chunkwise(
        q[:, :, split:], k[:, :, split:], v[:, :, split:], i[:, :, split:], f[:, :, split:], EPS, 5, state
    )
    torch.testing.assert_close(torch.cat([first, second], dim=2), whole, rtol=1e-10, atol=1e-10)
    for a, b in zip(state, state_whole):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    _, state_recurrent = mlstm_recurrent(q, k, v, i, f, EPS)
    for a, b in zip(state_recurrent, state_whole):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _layer(**overrides):
    args = ["model.d_model=24", "model.n_heads=3", "model.mlstm.chunk_size=4"]
    cfg = load_config(None, args + [f"model.mlstm.{k}={v}" for k, v in overrides.items()])
    torch.manual_seed(0)
    return MLstm(cfg.model).double()


def test_layer_shapes_are_half_width_qk_and_head_first():
    layer = _layer()
    assert (layer.qk_dim, layer.v_dim) == (4, 8)
    assert layer.q.weight.shape == (12, 24) and layer.v.weight.shape == (24, 24)
    assert layer.igate.weight.shape == (3, 24) and layer.fgate.bias.shape == (3,)
    assert layer.norm_weight.shape == (24,)  # head-major (3 heads × 8)
    assert torch.allclose(layer.igate.bias, torch.zeros(3, dtype=torch.float64))
    assert layer.conv.weight.shape == (24, 1, 4)  # q and k channels, depthwise, width 4
    assert torch.allclose(layer.fgate.bias, torch.tensor([3.0, 4.5, 6.0], dtype=torch.float64))


def test_layer_gates_are_soft_capped():
    layer = _layer(gate_soft_cap=2.0)
    with torch.no_grad():
        layer.igate.bias.fill_(1e3)
    i = layer.cell_inputs(torch.randn(1, 5, 24, dtype=torch.float64))[0][3]
    assert torch.allclose(i, torch.full_like(i, 2.0))


@pytest.mark.parametrize(
    "options", [{}, {"conv_size": 0, "igate_bias_init": -10.0}, {"conv_size": 3, "qk_dim_factor": 1.0}]
)
def test_layer_chunkwise_equals_token_by_token_and_trains(options):
    layer = _layer(**options)
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    y, state = layer.stream(x, None, SequenceInfo())  # chunkwise
    steps, step_state = [], None
    for t in range(11):  # one token per call: the recurrent form
        y_t, step_state = layer.stream(x[:, t : t + 1], step_state, SequenceInfo())
        steps.append(y_t)
    torch.testing.assert_close(y, torch.cat(steps, dim=1), rtol=1e-10, atol=1e-10)
    for a, b in zip(state, step_state):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer(x, SequenceInfo()), y)
    y.pow(2).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("head_norm", ["rms", "layer"])
def test_head_norm_is_rms_or_mean_centred_layer_norm_per_head(head_norm):
    layer = _layer(head_norm=head_norm)
    with torch.no_grad():
        layer.norm_weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    h = torch.randn(2, 3, 5, 8, dtype=torch.float64) * 2 + 1.5  # cell outputs of 3 heads, mean far from 0
    mean = h.mean(-1, keepdim=True) if head_norm == "layer" else 0.0
    centred = h - mean
    normed = centred / torch.sqrt((centred**2).mean(-1, keepdim=True) + layer.norm_eps)
    normed = normed * layer.norm_weight.view(3, 1, 8)
    expected = layer.out(torch.sigmoid(layer.ogate(x)) * normed.transpose(1, 2).reshape(2, 5, 24))
    assert torch.allclose(layer._output(x, h), expected, atol=1e-12)


def test_the_convolution_is_causal_and_depthwise_with_silu_as_written_plainly():
    """q, k after mlstm.conv_size=3: per channel c, silu(Σ_j w[c, j]·z[t − 2 + j]) with z the
    projection (zeros before the start); q, k of width d (qk_dim_factor 1); v untouched."""
    layer = _layer(conv_size=3, qk_dim_factor=1.0)
    assert (layer.qk_dim, layer.q.weight.shape, layer.conv.weight.shape) == (8, (24, 24), (48, 1, 3))
    x = torch.randn(2, 6, 24, dtype=torch.float64)
    (q, k, v, _, _), cache = layer.cell_inputs(x)
    z = torch.cat([layer.q(x), layer.k(x)], dim=-1)
    w = layer.conv.weight[:, 0]
    want = torch.zeros_like(z)
    for t in range(6):
        for j in range(3):
            if t - 2 + j >= 0:
                want[:, t] += w[:, j] * z[:, t - 2 + j]
    want = want * torch.sigmoid(want)
    as_heads = lambda a: a.view(2, 6, 3, 8).transpose(1, 2)  # noqa: E731
    torch.testing.assert_close(q, as_heads(want[..., :24]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k, as_heads(want[..., 24:]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v, as_heads(layer.v(x)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cache, z[:, -2:])
    assert _layer(conv_size=0).conv is None and "conv.weight" not in dict(_layer(conv_size=0).named_parameters())


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.mlstm.qk_dim_factor=0.3"], "model.mlstm.qk_dim_factor"),  # 7.2 of 24
        (["model.mlstm.qk_dim_factor=0.25"], "model.mlstm.n_heads"),  # 6 does not split into 4 heads
        (["model.mlstm.conv_size=-1"], "model.mlstm.conv_size"),
    ],
)
def test_bad_mlstm_shapes_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.d_model=24", "model.n_heads=4", "model.layer_pattern=[mlstm]", *overrides])
    assert e.value.key == key
