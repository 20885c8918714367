"""The decoder: embedding, a stack of (norm → mixer, norm → SwiGLU) blocks, final norm, LM head.

Each layer's mixer comes from `model.layer_pattern` through the `MIXERS` registry, so new mixers
(sliding-window attention, mLSTM, Gated DeltaNet) register here without touching the trunk.
"""
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megabam.config.schema import ModelConfig
from megabam.model.attention import SequenceInfo, build_attention
from megabam.model.layers import RMSNorm, SwiGLU, swiglu_hidden
from megabam.model.positional import sinusoidal_table

# mixer name → builder(model config, dict of modules shared across layers) → nn.Module(x, SequenceInfo)
MIXERS: dict[str, Callable[[ModelConfig, dict], nn.Module]] = {"attention": build_attention}


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer: nn.Module):
        super().__init__()
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden or swiglu_hidden(cfg.d_model))

    def forward(self, x: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x), seq)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        shared: dict = {}
        pattern = cfg.layer_pattern * (cfg.n_layers // len(cfg.layer_pattern))
        self.blocks = nn.ModuleList(Block(cfg, MIXERS[name](cfg, shared)) for name in pattern)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.sinusoidal = cfg.attention.positional == "sinusoidal"
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 scheme: N(0, std) everywhere, residual output projections shrunk by 1/sqrt(2·layers)
        # so the residual stream's variance does not grow with depth.
        residual_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual_out = name.endswith(("mixer.out", "mlp.down"))
                nn.init.normal_(module.weight, std=residual_std if is_residual_out else self.cfg.init_std)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        doc_ids: Optional[torch.Tensor] = None,
        window: Optional[int] = None,
    ) -> torch.Tensor:
        """Mean next-token cross-entropy when `labels` is given, else the logits (B, N, vocab)."""
        x = self.embed(input_ids)
        if self.sinusoidal:
            x = x + sinusoidal_table(input_ids.shape[1], x.shape[-1], device=x.device).to(x.dtype)
        seq = SequenceInfo(doc_ids=doc_ids, window=window)
        for block in self.blocks:
            x = block(x, seq)
        x = self.norm(x)
        logits = F.linear(x, self.embed.weight if self.lm_head is None else self.lm_head.weight)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per parameter use (the LM head counts even when tied) plus the
        mixers' own sequence-dependent work. Used for the MFU estimate."""
        dense = 6 * (self.num_params(exclude_embedding=True) + self.embed.weight.numel())
        mixing = sum(b.mixer.flops_per_token(seq_len) for b in self.blocks)
        return dense + mixing
