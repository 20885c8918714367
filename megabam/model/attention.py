"""The attention mixer: projections, positional scheme, SSMax parameters, and a call to the op.

The op itself (kernels/bam_attention.py) tiles over query blocks and evaluates the prior per tile,
so no N×N tensor exists at training lengths.
"""
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from kernels.bam_attention import bam_attention
from megabam.config.schema import ModelConfig
from megabam.model.positional import AlibiPrior, BamPrior, apply_rope, rope_tables


@dataclass
class SequenceInfo:
    """What every mixer may need to know about the batch besides the activations."""

    doc_ids: Optional[torch.Tensor] = None  # (B, N) document index per position, for document-aware masking
    window: Optional[int] = None  # per-call sliding window; overrides the configured one when set


def build_prior(cfg: ModelConfig, shared: dict) -> Optional[nn.Module]:
    """The prior module of one attention layer; `shared` carries the one instance when it is shared."""
    a = cfg.attention
    if a.positional == "alibi":
        return AlibiPrior(cfg.n_heads)
    if a.positional != "ggd_bam":
        return None
    if not a.bam.shared_across_layers:
        return BamPrior(cfg.n_heads, a.bam)
    if "bam_prior" not in shared:
        shared["bam_prior"] = BamPrior(cfg.n_heads, a.bam)
    return shared["bam_prior"]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, prior: Optional[nn.Module]):
        super().__init__()
        a = cfg.attention
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.prior = prior
        self.ssmax_s = nn.Parameter(torch.ones(cfg.n_heads)) if a.ssmax else None
        self.ssmax_before_prior = a.ssmax_before_prior
        self.rope_theta = a.rope_theta if a.positional == "rope" else None
        self.window = a.window
        self.document_aware = a.document_aware
        self.block_size = a.block_size

    def forward(self, x: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.rope_theta is not None:
            cos, sin = rope_tables(N, self.head_dim, self.rope_theta, device=x.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        theta_alpha, theta_beta, theta_mu = self.prior() if self.prior is not None else (None, None, None)
        y = bam_attention(
            q, k, v,
            theta_alpha=theta_alpha, theta_beta=theta_beta, theta_mu=theta_mu,
            ssmax_s=self.ssmax_s, ssmax_before_prior=self.ssmax_before_prior,
            doc_ids=seq.doc_ids if self.document_aware else None,
            window=seq.window if seq.window is not None else self.window,
            block_size=self.block_size,
        )
        return self.out(y.transpose(1, 2).reshape(B, N, -1))

    def flops_per_token(self, seq_len: int) -> float:
        """Forward+backward FLOPs of q·k and p·v per token (the projections are counted as parameters)."""
        # A causal row sees seq_len/2 keys on average; a window caps that.
        context = seq_len / 2 if self.window is None else min(self.window, seq_len / 2)
        return 12 * self.n_heads * self.head_dim * context


def build_attention(cfg: ModelConfig, shared: dict) -> Attention:
    return Attention(cfg, build_prior(cfg, shared))
