"""Positional schemes: the GGD-BAM prior parameters, ALiBi slopes, RoPE and sinusoidal tables.

The prior itself, −exp(θ_α)·(|j−i−μ|+ε)^θ_β, is evaluated inside the attention op per tile
(kernels/bam_attention.py); these modules only own its per-head parameters.
"""

import math

import torch
from torch import nn

from megabam.config.schema import BamConfig
from megabam.kernels import dispatch
from megabam.kernels.precision import compute_dtype


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The ALiBi paper's geometric slopes 2^(−8h/H), h = 1..H (interleaved for non-powers of two)."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (h + 1) for h in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two_slopes(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two_slopes(closest) + power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class BamPrior(nn.Module):
    """Per-head θ_α, θ_β, θ_μ of the generalized-Gaussian prior (one instance per layer, or shared)."""

    def __init__(self, n_heads: int, cfg: BamConfig):
        super().__init__()
        log_slopes = alibi_slopes(n_heads).log()
        if cfg.init == "alibi":
            theta_alpha, theta_beta = log_slopes, torch.ones(n_heads)
        elif cfg.init == "nope":
            theta_alpha, theta_beta = torch.zeros(n_heads), torch.zeros(n_heads)
        elif cfg.init == "spread":
            theta_alpha, theta_beta = log_slopes, torch.linspace(cfg.beta_range[0], cfg.beta_range[1], n_heads)
        else:  # mixed: the first heads ALiBi-like for local context, the rest flat for retrieval
            n_flat = round(cfg.flat_fraction * n_heads)
            local = n_heads - n_flat
            theta_alpha = torch.cat([log_slopes[:local], torch.zeros(n_flat)])
            theta_beta = torch.cat([torch.ones(local), torch.zeros(n_flat)])
        self.theta_alpha = nn.Parameter(theta_alpha.clone())
        self.theta_beta = nn.Parameter(theta_beta.clone())
        self.theta_mu = nn.Parameter(torch.zeros(n_heads), requires_grad=cfg.learn_mu)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.theta_alpha, self.theta_beta, self.theta_mu


class AlibiPrior(nn.Module):
    """ALiBi as the β=1 member of the same family, with fixed slopes (buffers, never trained)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.register_buffer("theta_alpha", torch.empty(n_heads), persistent=False)
        self.register_buffer("theta_beta", torch.empty(n_heads), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Set the fixed slopes, which checkpoints do not hold (they follow from the head count): at
        construction, and again where a model built on the meta device has its buffers materialised
        (the Hugging Face export's loader, megabam/convert/hf/modeling_megabam.py)."""
        with torch.no_grad():
            self.theta_alpha.copy_(alibi_slopes(self.n_heads).log())
            self.theta_beta.fill_(1.0)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, None]:
        return self.theta_alpha, self.theta_beta, None


def rope_rotation(seq_len: int, head_dim: int, theta: float, device=None, start: int = 0) -> torch.Tensor:
    """e^(i·p·ω_k) for positions p = start.. (start > 0 continues a stream) and ω_k = θ^(-2k/head_dim):
    (seq_len, head_dim/2) complex64."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(start, start + seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Rotate the pairs (x[2k], x[2k+1]) of a (B, N, heads, D) tensor by their position's angles: as
    complex numbers x[2k] + i·x[2k+1] times rotation (N, D/2). One complex multiply, forward and
    backward, where rotating the even and odd halves separately takes six elementwise passes; on CPU
    one pass in C where kernels/dispatch.py picks it (`backend`: model.kernels)."""
    if fused := dispatch.fused_cpu_op("rope", backend, x):
        return fused(x, rotation)
    pairs = torch.view_as_complex(x.to(compute_dtype(x)).unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation.to(pairs.dtype)[:, None]).flatten(-2).type_as(x)


def sinusoidal_table(seq_len: int, dim: int, device=None, start: int = 0) -> torch.Tensor:
    """The original Transformer's absolute position embedding of positions start.., added to the token embeddings."""
    position = torch.arange(start, start + seq_len, device=device, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(seq_len, dim, device=device)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: dim // 2])
    return table


class SinusoidalPositions(nn.Module):
    """Adds the sinusoidal embeddings of positions start.. to token embeddings x (B, N, d).

    A module, not a call in the decoder, so sequence parallelism can swap in one that offsets `start`
    by the position of this rank's sequence shard.
    """

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        return x + sinusoidal_table(x.shape[1], x.shape[-1], device=x.device, start=start).to(x.dtype)
