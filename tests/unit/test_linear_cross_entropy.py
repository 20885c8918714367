"""kernels.linear_cross_entropy (the chunked output loss) against the cross-entropy written out in
float64, and the gradients autograd gives that."""

import pytest
import torch

from megabam.kernels.linear_cross_entropy import linear_cross_entropy


def reference(h, w, y):
    """-log softmax(h·Wᵀ)[y], averaged over tokens, by hand in float64."""
    logits = h.double() @ w.double().t()
    log_z = logits.exp().sum(-1).log()
    return (log_z - logits.gather(-1, y[..., None]).squeeze(-1)).mean()


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk", [1, 7, 1024])  # one token, chunks not dividing the 30 tokens, one chunk
def test_loss_and_gradients_match_float64(dtype, tol, chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 10, 16, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(50, 16, generator=g, dtype=torch.float64) / 4).to(dtype).requires_grad_()
    y = torch.randint(0, 50, (3, 10), generator=g)
    loss = linear_cross_entropy(h, w, y, chunk_tokens=chunk)
    (2.5 * loss).backward()  # the incoming gradient scales both
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    want = reference(h64, w64, y)
    (2.5 * want).backward()
    assert loss.dtype == dtype
    assert abs(loss.item() - want.item()) <= tol * want.item()
    for got, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert got.dtype == dtype and got.shape == ref.shape
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)


def test_no_gradient_wanted_computes_the_loss_only():
    h, w = torch.randn(2, 5, 8), torch.randn(20, 8, requires_grad=True)
    y = torch.randint(0, 20, (2, 5))
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, y, chunk_tokens=3)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss.double(), reference(h, w, y), rtol=1e-5, atol=1e-5)
    frozen = linear_cross_entropy(h.requires_grad_(), w.detach(), y)  # only h wants a gradient
    frozen.backward()
    assert h.grad is not None


def test_bf16_inputs_compute_in_fp32():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 6, 8, generator=g).bfloat16().requires_grad_()
    w = torch.randn(30, 8, generator=g).bfloat16().requires_grad_()
    y = torch.randint(0, 30, (4, 6), generator=g)
    loss = linear_cross_entropy(h, w, y)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), reference(h.float(), w.float(), y), rtol=1e-5, atol=1e-5)
