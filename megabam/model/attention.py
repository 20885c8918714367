"""The attention mixers: projections, positional scheme, SSMax parameters, and a call to the op.

Two mixers share the `Attention` module: full causal attention (`attention`, settings
`model.attention`) and sliding-window attention (`swa`, settings `model.swa`, RoPE by default). The
op itself (kernels/bam_attention.py) tiles over query blocks, evaluates the prior per tile and, with
a window, touches only the key tiles the window reaches, so no N×N tensor exists and SWA costs N·w.
"""

import math
from typing import NamedTuple

import torch
from torch import nn

from megabam.config.schema import AttentionConfig, ModelConfig
from megabam.kernels.bam_attention import AttentionOptions, dense_bam_attention, dense_bam_weights
from megabam.kernels.dispatch import attention
from megabam.model.layers import SequenceInfo
from megabam.model.positional import AlibiPrior, BamPrior, apply_rope, rope_rotation
from megabam.model.registry import register_mixer
from megabam.model.sharding import TensorParallelPlan


class KVCache(NamedTuple):
    """Keys (after RoPE) and values an attention layer keeps while streaming, (B, H, S, D) each.

    SWA layers keep a ring buffer of S = window slots (slot p mod window holds position p); full
    attention layers keep every position seen (S grows). `positions` (S,) holds each slot's position,
    -1 while empty; `length` is the number of tokens streamed so far.
    """

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    length: int


def build_prior(cfg: ModelConfig, a: AttentionConfig, shared: dict, section: str) -> nn.Module | None:
    """The prior module of one attention layer configured by `a` (the model config's `section`);
    `shared` carries the one instance per section when it is shared across layers."""
    if a.positional == "alibi":
        return AlibiPrior(cfg.n_heads)
    if a.positional != "ggd_bam":
        return None
    if not a.bam.shared_across_layers:
        return BamPrior(cfg.n_heads, a.bam)
    key = f"bam_prior/{section}"
    if key not in shared:
        shared[key] = BamPrior(cfg.n_heads, a.bam)
    return shared[key]


class Attention(nn.Module):
    """Causal attention configured by one attention section. `sliding` layers (SWA) take the window of
    each call (SequenceInfo.window) and fall back to their configured one; the others use theirs."""

    kernel_calls = ("attend",)  # the methods that call a kernel (megabam/parallel/compile.py)

    def __init__(self, cfg: ModelConfig, a: AttentionConfig, prior: nn.Module | None, sliding: bool = False):
        super().__init__()
        kv_heads = a.kv_heads or cfg.n_heads  # grouped-query attention when fewer than n_heads
        self.group = cfg.n_heads // kv_heads  # query heads per key/value head
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.prior = prior
        self.ssmax_s = nn.Parameter(torch.full((cfg.n_heads,), a.ssmax_init)) if a.ssmax else None
        self.ssmax_before_prior = a.ssmax_before_prior
        self.ssmax_key_cap = a.ssmax_key_cap
        self.positional = a.positional
        self.rope_theta = a.rope_theta if a.positional == "rope" else None
        self.window = a.window
        self.sliding = sliding
        self.document_aware = a.document_aware
        self.block_size = a.block_size
        self.backend = cfg.kernels

    @property
    def kv_heads(self) -> int:
        """Key/value heads this module holds (all of them, or this rank's under tensor parallelism)."""
        return self.qkv.weight.shape[0] // ((self.group + 2) * self.head_dim)

    @property
    def n_heads(self) -> int:
        return self.group * self.kv_heads

    def tp_plan(self) -> TensorParallelPlan:
        """Whole heads per rank: q, k, v of the same heads (each rank's kv heads serve its query
        heads), their rows of the output projection, and each head's prior θ and SSMax s."""
        q_rows, kv_rows = self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        return TensorParallelPlan(
            column={"qkv": [q_rows, kv_rows, kv_rows]},
            row=("out",),
            heads=("ssmax_s", "prior"),
            head_counts={"attention": self.n_heads, "attention key/value": self.kv_heads},
        )

    def _project(self, x: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, n_heads, N, D) and k, v (B, kv_heads, N, D) from the fused projection [q | k | v], q and
        k rotated together under RoPE (positions start..)."""
        B, N, _ = x.shape
        qk, v = self.qkv(x).view(B, N, -1, self.head_dim).split([self.n_heads + self.kv_heads, self.kv_heads], dim=2)
        if self.rope_theta is not None:
            rotation = rope_rotation(N, self.head_dim, self.rope_theta, device=x.device, start=start)
            qk = apply_rope(qk, rotation, self.backend)
        q, k = qk.split([self.n_heads, self.kv_heads], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _options(self, seq: SequenceInfo, keys: int) -> AttentionOptions:
        """The options of this call of the op, whose rows see at most `keys` keys: made per call, since θ
        and s are parameters that each step updates."""
        theta_alpha, theta_beta, theta_mu = self.prior() if self.prior is not None else (None, None, None)
        key_cap = None
        # Only a call that can reach the cap carries it (never a training call: the cap is at least
        # data.seq_len), so training builds no per-head tensor and the dispatch never reads one.
        reached = self.ssmax_key_cap is not None and keys > self.ssmax_key_cap
        if reached and self.ssmax_s is not None and theta_beta is not None:
            # Capped: the heads whose prior decays with distance (θ_β > 0), local by their prior.
            inf = torch.tensor(math.inf, device=theta_beta.device)
            key_cap = torch.where(theta_beta.detach() > 0, float(self.ssmax_key_cap), inf)
        return AttentionOptions(
            theta_alpha=theta_alpha,
            theta_beta=theta_beta,
            theta_mu=theta_mu,
            ssmax_s=self.ssmax_s,
            ssmax_before_prior=self.ssmax_before_prior,
            doc_ids=seq.doc_ids if self.document_aware else None,
            window=self.window_of(seq),
            block_size=self.block_size,
            ssmax_key_cap=key_cap,
        )

    @torch.no_grad()
    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """The attention probabilities (B, n_heads, N, N) of one document x (B, N, d), for plots."""
        q, k, _ = self._project(x)
        positions = torch.arange(x.shape[1], device=x.device)
        return dense_bam_weights(q, k, positions, positions, self._options(SequenceInfo(), x.shape[1]))

    def forward(self, x: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = self._project(x)
        y = self.attend(q, k, v, seq)
        return self.out(y.transpose(1, 2).reshape(B, N, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        """The call of the op (kernels/dispatch.py), this call's options included: a compiled block runs
        it outside its graphs (megabam/parallel/compile.py), so the per-step window never reaches them."""
        return attention(q, k, v, self._options(seq, q.shape[-2]), backend=self.backend)

    def stream(self, x: torch.Tensor, cache: KVCache | None, seq: SequenceInfo) -> tuple[torch.Tensor, KVCache]:
        """Continue a stream (inference): x (B, C, d) are the next C tokens after those in `cache`
        (None = start). One document per stream; the output equals `forward` on the whole stream.

        The C queries attend densely to the cached keys and their own; with a window the cache is a
        ring of `window` slots, so memory and work per token do not grow with the context.
        """
        B, C, _ = x.shape
        window = self.window_of(seq)
        start = 0 if cache is None else cache.length
        q, k, v = self._project(x, start)
        if cache is not None and window is not None and cache.k.shape[2] != window:
            raise ValueError(f"the stream was started with window {cache.k.shape[2]}, not {window}")
        if cache is None:
            slots = 0 if window is None else window
            empty = k.new_zeros(B, self.kv_heads, slots, self.head_dim)
            cache = KVCache(empty, empty, torch.full((slots,), -1, dtype=torch.long, device=x.device), 0)
        new_pos = torch.arange(start, start + C, device=x.device)
        keys, values = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        # Without a window the cache holds every earlier position in order, so the chunk is computed
        # in order (block by block); a window's ring is read densely.
        y = dense_bam_attention(
            q,
            keys,
            values,
            new_pos,
            torch.cat([cache.positions, new_pos]),
            self._options(seq, start + C),
            in_order=window is None,
        )
        if window is None:
            cache = KVCache(keys, values, torch.cat([cache.positions, new_pos]), start + C)
        else:  # write the last min(C, window) tokens into their ring slots
            keep = min(C, window)
            slots = new_pos[-keep:] % window
            cache = KVCache(
                cache.k.index_copy(2, slots, k[:, :, -keep:]),
                cache.v.index_copy(2, slots, v[:, :, -keep:]),
                cache.positions.index_copy(0, slots, new_pos[-keep:]),
                start + C,
            )
        return self.out(y.transpose(1, 2).reshape(B, C, -1)), cache

    def window_of(self, seq: SequenceInfo) -> int | None:
        return seq.window if (self.sliding and seq.window is not None) else self.window

    def mixing_flops(self, seq_len: int, window: int | None = None, causal: bool = True) -> dict[str, float]:
        """Forward FLOPs per token of the sequence mixing (the projections count as parameters), SWA
        layers at `window` (None = their configured one). q·k and p·v run over the keys a query sees on
        average: a causal window w over n tokens is n·w − w²/2 dot products per head, full causal n²/2.
        A positional prior adds one add per logit, SSMax one multiply per query element (its row factor
        scales the queries). causal=False counts every query against min(w, n) keys, the masked
        triangle whole (counts.py: the convention of published MFU)."""
        w = window if (self.sliding and window is not None) else self.window
        if not causal:
            keys = seq_len if w is None else min(w, seq_len)
        else:
            keys = seq_len / 2 if w is None or w >= seq_len else w - w * w / (2 * seq_len)
        parts = {
            "scores": 2.0 * self.n_heads * self.head_dim * keys,
            "values": 2.0 * self.n_heads * self.head_dim * keys,
        }
        if self.prior is not None:
            parts["prior"] = float(self.n_heads * keys)
        if self.ssmax_s is not None:
            parts["ssmax"] = float(self.n_heads * self.head_dim)
        return parts


@register_mixer("attention")
def build_attention(cfg: ModelConfig, shared: dict) -> Attention:
    """Full causal attention (`attention`), settings model.attention."""
    return Attention(cfg, cfg.attention, build_prior(cfg, cfg.attention, shared, "attention"))


@register_mixer("swa")
def build_sliding_window_attention(cfg: ModelConfig, shared: dict) -> Attention:
    """Sliding-window attention (`swa`), settings model.swa; the window may change with every call."""
    return Attention(cfg, cfg.swa, build_prior(cfg, cfg.swa, shared, "swa"), sliding=True)
