"""Gated DeltaNet: the chunkwise and recurrent forms against a float64 step loop written from the
equations (methods.md §2), forward and gradients; the layer's state carries a sequence across calls."""

import math

import pytest
import torch
import torch.nn.functional as F

from megabam.config import load_config
from megabam.kernels.gated_deltanet import gated_delta_chunkwise, gated_delta_recurrent
from megabam.model.gated_deltanet import GatedDeltaNet
from megabam.model.layers import SequenceInfo

B, H, N, DK, DV = 2, 3, 13, 4, 5


def reference(q, k, v, g, beta):
    """S ← exp(g)S; v' = β(v − Sᵀk); S ← S + k v'ᵀ; o = Sᵀ(q/√d_k), one (batch, head) at a time."""
    rows = []
    for b in range(B):
        for h in range(H):
            S = torch.zeros(DK, DV, dtype=q.dtype)
            outs = []
            for t in range(N):
                S = torch.exp(g[b, h, t]) * S
                v_new = beta[b, h, t] * (v[b, h, t] - S.T @ k[b, h, t])
                S = S + torch.outer(k[b, h, t], v_new)
                outs.append(S.T @ (q[b, h, t] / math.sqrt(DK)))
            rows.append(torch.stack(outs))
    return torch.stack(rows).view(B, H, N, DV)


def inputs(seed=0, strong_decay=False):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, N, DK, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, H, N, DK, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, N, DV, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, H, N, generator=gen, dtype=torch.float64) * (30.0 if strong_decay else 1.0)
    beta = torch.rand(B, H, N, generator=gen, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


@pytest.mark.parametrize("strong_decay", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 4, 5, 13, 32])
def test_chunkwise_and_recurrent_match_reference(chunk_size, strong_decay):
    x = inputs(strong_decay=strong_decay)
    weight = torch.randn(B, H, N, DV, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    want = reference(*x)
    want_grads = torch.autograd.grad((want * weight).sum(), x)
    for name, got in [
        ("chunkwise", gated_delta_chunkwise(*x, chunk_size)[0]),
        ("recurrent", gated_delta_recurrent(*x)[0]),
    ]:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)
        for g, w in zip(torch.autograd.grad((got * weight).sum(), x), want_grads):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=name)


def test_chunkwise_final_state_equals_recurrent():
    x = [t.detach() for t in inputs(seed=2)]
    _, s_chunk = gated_delta_chunkwise(*x, 4)
    _, s_rec = gated_delta_recurrent(*x)
    torch.testing.assert_close(s_chunk, s_rec, rtol=1e-10, atol=1e-10)


def test_layer_state_carries_across_calls_and_forms():
    cfg = load_config(
        None,
        [
            "model.d_model=24",
            "model.n_heads=3",
            "model.gated_deltanet.chunk_size=4",
            "model.gated_deltanet.conv_size=3",
        ],
    )
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg.model).double()
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    whole, whole_state = layer.stream(x, None, SequenceInfo())
    parts, state = [], None
    for start, end in [(0, 6), (6, 7), (7, 8), (8, 11)]:  # chunkwise, recurrent, recurrent, chunkwise
        y, state = layer.stream(x[:, start:end], state, SequenceInfo())
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state.S, whole_state.S, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state.conv, whole_state.conv)
    whole.pow(2).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    # Decays g = −exp(A)·softplus(·) are negative; the gate β lies in (0, 1).
    _, _, _, g, beta = layer.cell_inputs(x, None)[0]
    assert (g < 0).all() and ((beta > 0) & (beta < 1)).all()
