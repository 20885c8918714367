"""The mean next-token cross-entropy of the logits h·Wᵀ, without ever holding all the logits.

The output layer's logits are the largest activation of a small model (tokens × vocabulary: 2,048 ×
4,096 fp32 is 32 MiB per step for megabam's tiny CPU models; 16k × 32k is 2 GiB per sequence at
scale), and the usual path writes them, their log-softmax, and in the backward the gradient of each,
in full. Here each chunk of tokens has its logits, their log-sum-exp and, when a gradient is wanted,
the softmax gradient (softmax - onehot) computed while the chunk is in cache, and the chunk's
contributions to dL/dh and dL/dW taken at once; the backward only scales those by the incoming
gradient. Peak memory: one chunk of logits plus dL/dh and dL/dW. Computed in the compute dtype.
"""

import torch
from torch import Tensor

from megabam.kernels.precision import compute_dtype

CHUNK_TOKENS = 1024


def _chunks(x: Tensor, y: Tensor, weight: Tensor, chunk: int, gradients: tuple[bool, bool]):
    """(loss sum, dL/dx, dL/dW) of the summed cross-entropy; the gradients None where not wanted."""
    dtype = compute_dtype(x)
    w = weight.to(dtype)
    dx = torch.empty(x.shape, dtype=dtype, device=x.device) if gradients[0] else None
    dw = torch.zeros(w.shape, dtype=dtype, device=x.device) if gradients[1] else None
    total = torch.zeros((), dtype=dtype, device=x.device)
    for s in range(0, x.shape[0], chunk):
        xs, ys = x[s : s + chunk].to(dtype), y[s : s + chunk]
        logits = xs @ w.t()
        target = logits.gather(1, ys[:, None])
        # log-sum-exp by hand, in the logits' memory: torch.logsumexp would write exp(logits - max) to
        # a new tensor, and the softmax below needs exactly that.
        top = logits.amax(-1, keepdim=True)
        exp = logits.sub_(top).exp_()
        sum_exp = exp.sum(-1, keepdim=True)
        total += (top + sum_exp.log() - target).sum()
        if dx is not None or dw is not None:
            grad = exp.div_(sum_exp)  # softmax
            grad[torch.arange(len(ys), device=x.device), ys] -= 1
            if dx is not None:
                torch.matmul(grad, w, out=dx[s : s + chunk])
            if dw is not None:
                dw.addmm_(grad.t(), xs)
            del grad
        del logits, exp  # else the next chunk's logits are made while this chunk's are still held
    return total, dx, dw


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk):
        x, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
        total, dx, dw = _chunks(x, y, weight, chunk, ctx.needs_input_grad[:2])
        n = x.shape[0]
        ctx.save_for_backward(dx, dw)
        ctx.shapes = (h.shape, h.dtype, weight.dtype, n)
        return total / n

    @staticmethod
    def backward(ctx, grad_loss):
        dx, dw = ctx.saved_tensors
        shape, h_dtype, w_dtype, n = ctx.shapes
        scale = grad_loss / n  # the mean over tokens
        dh = None if dx is None else (dx * scale).to(h_dtype).view(shape)
        return dh, None if dw is None else (dw * scale).to(w_dtype), None, None


def linear_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int = CHUNK_TOKENS) -> Tensor:
    """Mean cross-entropy of softmax(h @ weightᵀ) against labels: h (..., d), weight (V, d), labels
    (...) token ids; equal to F.cross_entropy(h @ weight.T, labels) (in the compute dtype, fp32 for
    lower precisions). Gradients flow to h and weight."""
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, labels, chunk_tokens)
    x, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    return _chunks(x, y, weight, chunk_tokens, (False, False))[0] / x.shape[0]
