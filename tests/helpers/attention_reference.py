"""BAM attention written plainly from the formula (methods.md §1), densely in float64: the reference
the attention ops' tests compare against."""

import math

import torch


def dense_reference(
    q, k, v, alpha=None, beta=None, mu=None, s=None, before_prior=False, doc_ids=None, window=None, key_cap=None
):
    """Full N x N float64 BAM attention; autograd gives its gradients. `key_cap` (H,): SSMax counts at
    most that many keys in each head."""
    n = q.shape[-2]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    allowed = (j <= i) & ((j > i - window) if window is not None else True)
    allowed = allowed.expand(q.shape[0], n, n)
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    qk = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    prior = 0
    if alpha is not None:
        m = 2 * torch.sinh(mu) if mu is not None else torch.zeros_like(alpha)
        d = (j - i) - m[:, None, None]
        prior = -torch.exp(alpha)[:, None, None] * (d.abs() + 1e-5) ** beta[:, None, None]
    logits = qk + prior
    if s is not None:
        n = allowed.sum(-1).to(q.dtype)[:, None, :, None]  # keys row i may attend to, (B, 1, N, 1)
        if key_cap is not None:
            n = torch.minimum(n, key_cap.to(q.dtype)[None, :, None, None])
        c = s[None, :, None, None] * torch.log(n)
        logits = qk * c + prior if before_prior else logits * c
    return torch.softmax(logits.masked_fill(~allowed[:, None], -math.inf), -1) @ v
