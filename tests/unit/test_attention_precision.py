"""fp32 gradients of the attention ops against a float64 oracle, measured beside torch's dense fp32
autograd on the same inputs: where logits or priors are large (q, k × 30; a prior that keeps every
visible key far below zero), a key-tiled backward's rounding (one logsumexp, delta = rowsum(dO·O))
used to leave each row's dS summing to noise that the θ and s reductions multiplied into spurious
gradients (0.05 on heads whose true gradient is 1e-87). Each op (the Triton kernel under the
interpreter) must stay within 10× of dense autograd's error, and heads whose true gradient is ~0
must get ~0."""

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernel's module is imported (as test_kernels_triton)
from helpers.attention_reference import dense_reference  # noqa: E402

import megabam.kernels.bam_attention_cpu as c_tiles  # noqa: E402
import megabam.kernels.bam_attention_triton as kt  # noqa: E402
from megabam.kernels.bam_attention import AttentionOptions, bam_attention  # noqa: E402

assert kt.INTERPRET, "kernels.bam_attention_triton was imported before TRITON_INTERPRET=1 was set"

H = 4
THETAS = dict(alpha=[0.0, -2, 1, -4], beta=[1.0, 0.5, -1, 2], mu=[0.0, 0.3, -0.2, 0.1], s=[1.0, 0.8, 1.2, 0.5])
# θμ ahead of every query (μ = 2·sinh θμ ≈ 20 and 12), steep: each row's softmax is one key; heads 0
# and 1 have true gradients of ~1e-87 and ~1e-10 beside heads 2 and 3's of ~10.
STEEP = dict(alpha=[2.0, 2.0, 0.0, 1.0], beta=[2.0, 1.5, 1.0, 0.0], mu=[3.0, 2.5, 0.0, 0.2], s=[1.0] * H)
CASES = {
    "ordinary": (1.0, THETAS, False),
    "q, k x30": (30.0, THETAS, False),
    "q, k x30, SSMax before the prior": (30.0, THETAS, True),
    "prior ahead and steep": (1.0, STEEP, False),
}


def inputs(seed: int, size: float, n: int = 96, d: int = 32):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, H, n, d, generator=g, dtype=torch.float64) * size for _ in range(2))
    v, dout = (torch.randn(1, H, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, dout


def gradients(op, tensors, thetas, before, dtype) -> dict:
    q, k, v, dout = (t.to(dtype).clone().requires_grad_() for t in tensors)
    th = {key: torch.tensor(value, dtype=dtype, requires_grad=True) for key, value in thetas.items()}
    if op is None:
        out = dense_reference(q, k, v, th["alpha"], th["beta"], th["mu"], th["s"], before)
    else:
        options = AttentionOptions(
            theta_alpha=th["alpha"],
            theta_beta=th["beta"],
            theta_mu=th["mu"],
            ssmax_s=th["s"],
            ssmax_before_prior=before,
        )
        out = op(q, k, v, options)
    out.backward(dout.detach())
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad, **{key: t.grad for key, t in th.items()}}


def op_named(name: str):
    """The PyTorch op, the C kernel's, or the Triton kernel's under the interpreter."""
    if name == "reference":
        return bam_attention
    if name == "triton":
        return kt.bam_attention_triton
    assert c_tiles.library() is not None, "the C tiles did not build (see the warning logged)"
    return c_tiles.bam_attention_cpu


# The interpreter (slow) runs the two cases the old kernel failed on; the others are the CPU ops' and
# tests/unit/test_kernels_triton.py's.
PAIRS = [(name, case) for name in ("reference", "c_tiles") for case in CASES]
PAIRS += [("triton", "q, k x30"), ("triton", "prior ahead and steep")]


@pytest.mark.parametrize("name, case", PAIRS)
def test_fp32_gradients_within_10x_of_dense_autograd(name, case):
    op = op_named(name)
    size, thetas, before = CASES[case]
    tensors = inputs(sum(map(ord, case)), size)
    oracle = gradients(None, tensors, thetas, before, torch.float64)
    dense = gradients(None, tensors, thetas, before, torch.float32)
    got = gradients(op, tensors, thetas, before, torch.float32)
    for name, want in oracle.items():
        scale = want.abs().max().item()
        err = (got[name].double() - want).abs()
        dense_err = (dense[name].double() - want).abs()
        # The whole tensor: its largest error beside dense autograd's (plus a few ulps of its size).
        assert err.max() <= 10 * dense_err.max() + 1e-6 * scale, (name, err.max().item(), dense_err.max().item())
        if want.dim() == 1:  # per head: a head whose true gradient is ~0 must get ~0, not noise
            quiet = want.abs() < 1e-6 * scale
            assert (err[quiet] <= 10 * dense_err[quiet] + 1e-12 * scale).all(), (name, err, dense_err, want)
