"""Sliding-window attention mixer against a dense masked float64 reference (RoPE written independently,
with complex numbers), the per-call window, and the tile skipping that makes its cost N·w."""

import math

import pytest
import torch

import megabam.kernels.bam_attention as bam
from megabam.config import load_config
from megabam.model import MIXERS
from megabam.model.layers import SequenceInfo

D, HEADS, BLOCK = 32, 4, 32


def _swa(*overrides, seq_len=512):
    cfg = load_config(
        None,
        [
            f"model.d_model={D}",
            f"model.n_heads={HEADS}",
            f"data.seq_len={seq_len}",
            "model.layer_pattern=[swa]",
            f"model.swa.block_size={BLOCK}",
            "model.swa.window=64",
            "window.windows=[16, 64]",
            *overrides,
        ],
    )
    torch.manual_seed(0)
    return MIXERS["swa"](cfg.model, {}).double(), cfg


def rotate(x, theta=10000.0):
    """RoPE as a complex rotation of consecutive pairs by position·theta^(−2i/d)."""
    n, d = x.shape[-2:]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * freq
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous()) * torch.polar(
        torch.ones_like(angle), angle
    )
    return torch.view_as_real(z).flatten(-2)


def dense_reference(layer, x, window):
    B, N, _ = x.shape
    q, k, v = (x @ layer.qkv.weight.T).view(B, N, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
    q, k = rotate(q), rotate(k)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    allowed = (j <= i) & (j > i - window)
    logits = (q @ k.transpose(-1, -2) / math.sqrt(D // HEADS)).masked_fill(~allowed, -math.inf)
    y = torch.softmax(logits, -1) @ v
    return y.transpose(1, 2).reshape(B, N, D) @ layer.out.weight.T


@pytest.mark.parametrize("window", [1, 7, 128, 150, 1000])
def test_matches_dense_masked_reference(window):
    layer, _ = _swa()
    n = 150  # not a multiple of the 32-row tile
    x = torch.randn(2, n, D, dtype=torch.float64, requires_grad=True)
    got = layer(x, SequenceInfo(window=window))
    want = dense_reference(layer, x, window)
    # 1e-6: the model's RoPE tables are fp32 (as in training); everything else runs in float64.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (gx,) = torch.autograd.grad(got.sum(), x)
    (wx,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(gx, wx, rtol=1e-6, atol=1e-6)


def test_window_comes_from_the_call_else_the_config():
    layer, _ = _swa()
    x = torch.randn(1, 100, D, dtype=torch.float64)
    for call, window in [(None, 64), (9, 9), (30, 30)]:
        torch.testing.assert_close(
            layer(x, SequenceInfo(window=call)), dense_reference(layer, x, window), rtol=1e-6, atol=1e-6
        )


def test_full_attention_ignores_the_call_window():
    cfg = load_config(
        None,
        [
            f"model.d_model={D}",
            f"model.n_heads={HEADS}",
            "model.attention.positional=rope",
            "model.attention.ssmax=false",
        ],
    )
    torch.manual_seed(0)
    layer = MIXERS["attention"](cfg.model, {}).double()
    x = torch.randn(1, 40, D, dtype=torch.float64)
    torch.testing.assert_close(layer(x, SequenceInfo(window=3)), layer(x, SequenceInfo()))


def test_cost_grows_as_n_times_window(monkeypatch):
    """Each query tile touches at most tile + w − 1 key columns, so total work is N·(tile + w) (the
    tiled op; tests/unit/test_attention_sdpa.py checks the same of the fused CPU path)."""
    widths, real = [], bam.block_logits

    def counting(q, k, *args):
        widths.append(k.shape[-2])
        return real(q, k, *args)

    monkeypatch.setattr(bam, "block_logits", counting)
    layer, _ = _swa("model.kernels=reference")
    n, w = 500, 16
    layer(torch.randn(1, n, D, dtype=torch.float64), SequenceInfo(window=w))
    assert len(widths) == math.ceil(n / BLOCK) and max(widths) <= BLOCK + w - 1


@pytest.mark.parametrize("positional", ["ggd_bam", "alibi", "nope", "sinusoidal"])
def test_any_positional_scheme_is_allowed(positional):
    layer, _ = _swa(f"model.swa.positional={positional}", "model.swa.ssmax=true")
    y = layer(torch.randn(1, 40, D, dtype=torch.float64), SequenceInfo(window=5))
    assert torch.isfinite(y).all() and layer.positional == positional
