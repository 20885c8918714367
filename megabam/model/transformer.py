"""The decoder: embedding, a stack of (norm → mixer, norm → SwiGLU) blocks, final norm, LM head.

Each layer's mixer comes from `model.layer_pattern` through the `MIXERS` registry (registry.py): full attention,
sliding-window attention, mLSTM and Gated DeltaNet, in any sequence (SWAX is `[SM]`: SWA and mLSTM 1:1).
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megabam.config.schema import ModelConfig
from megabam.kernels.linear_cross_entropy import linear_cross_entropy

# The mixer modules register their builders in MIXERS when imported.
from megabam.model import attention, gated_deltanet, mlstm  # noqa: F401
from megabam.model.layers import RMSNorm, SequenceInfo, SwiGLU
from megabam.model.positional import SinusoidalPositions
from megabam.model.registry import MIXERS


class VocabOutput(nn.Module):
    """Logits h·Wᵀ over the vocabulary, or, given labels, the mean next-token cross-entropy.

    Holds no weights: W is the embedding's when tied, else the LM head's. It is a module of its own so
    tensor parallelism can swap in a vocab-parallel version (megabam/parallel/tensor_parallel.py) that
    computes the loss without gathering the logits. The steps are separate methods because a
    pipeline's last stage computes `local_logits` and DeepSpeed then calls `loss` on them; with the
    whole vocabulary on one rank, `hidden_loss` goes from h to the loss in chunks of tokens
    (kernels/linear_cross_entropy.py) without holding all the logits. With `soft_cap` every logit is
    cap·tanh(z/cap) (xLSTM-7B's output), and the loss takes the capped logits whole.
    """

    def __init__(self, soft_cap: float | None = None):
        super().__init__()
        self.soft_cap = soft_cap

    def forward(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return self.full_logits(self.local_logits(h, weight))
        return self.hidden_loss(h, weight, labels)

    def hidden_loss(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.soft_cap is not None:
            return self.loss(self.local_logits(h, weight), labels)
        return linear_cross_entropy(h, weight, labels)

    def enter(self, h: torch.Tensor) -> torch.Tensor:
        """The final hidden states as the head sees them."""
        return h

    def local_logits(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The logits this rank computes (all of them here; a vocabulary shard under TP)."""
        logits = F.linear(self.enter(h), weight)
        return logits if self.soft_cap is None else self.soft_cap * torch.tanh(logits / self.soft_cap)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The most likely token at each position, from this rank's logits."""
        return logits.argmax(-1)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer: nn.Module):
        super().__init__()
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernels)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernels)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden_size(), cfg.kernels)

    def forward(self, x: torch.Tensor, seq: SequenceInfo) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x), seq)
        return x + self.mlp(self.mlp_norm(x))

    def stream(self, x: torch.Tensor, state, seq: SequenceInfo):
        y, state = self.mixer.stream(self.mixer_norm(x), state, seq)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), state


class DecoderState(NamedTuple):
    """What `Decoder.stream` carries between calls: each layer's cache or recurrent state (a KVCache,
    MLstmLayerState or GatedDeltaNetState) and the number of tokens streamed so far."""

    layers: list
    length: int


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        shared: dict = {}
        self.layer_types = cfg.layer_types()
        self.blocks = nn.ModuleList(Block(cfg, MIXERS[name](cfg, shared)) for name in self.layer_types)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernels)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.output = VocabOutput(cfg.logit_soft_cap)
        self.sinusoidal = cfg.sinusoidal_positions()
        self.positions = SinusoidalPositions()
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
        labels: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """Mean next-token cross-entropy when `labels` is given, else the logits (B, N, vocab).
        `window` is the sliding-window layers' window for this call (the trainer sets it per step from
        the window sampler); None = model.swa.window. Full attention layers ignore it."""
        return self.output(self._final_hidden(input_ids, doc_ids, window), self._head_weight(), labels)

    @torch.no_grad()
    def greedy(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The most likely next token at each position (B, N), one document per row and the configured
        SWA window. The output takes the argmax itself, so a vocab-parallel one never gathers logits."""
        logits = self.output.local_logits(self._final_hidden(input_ids, None, None), self._head_weight())
        return self.output.greedy(logits)

    def _final_hidden(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None, window: int | None) -> torch.Tensor:
        """The normed hidden states the output reads."""
        x = self.embed(input_ids)
        if self.sinusoidal:
            x = self.positions(x)
        seq = SequenceInfo(doc_ids=doc_ids, window=window)
        for block in self.blocks:
            x = block(x, seq)
        return self.norm(x)

    def _head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def stream(
        self, input_ids: torch.Tensor, state: DecoderState | None = None, window: int | None = None
    ) -> tuple[torch.Tensor, DecoderState]:
        """Recurrent inference: the logits (B, C, vocab) of the next C tokens of a stream whose earlier
        tokens `state` holds (None = start), and the state after them. Equal to `forward` on the whole
        stream with the same SWA window (default model.swa.window); one document per stream.

        SWA layers keep a ring buffer of their last `window` keys and values, mLSTM and Gated DeltaNet
        layers their fixed-size state, so a SWAX model's memory does not grow with the context. Full
        attention layers, where a pattern has them, keep every key and value (a growing KV cache).
        Prompts can go in as one chunk (chunkwise forms); generation feeds one token per call
        (recurrent forms).
        """
        start = 0 if state is None else state.length
        layer_states = [None] * len(self.blocks) if state is None else state.layers
        x = self.embed(input_ids)
        if self.sinusoidal:
            x = self.positions(x, start)
        seq = SequenceInfo(window=window)
        new_states = []
        for block, layer_state in zip(self.blocks, layer_states):
            x, layer_state = block.stream(x, layer_state, seq)
            new_states.append(layer_state)
        return self.output(self.norm(x), self._head_weight()), DecoderState(new_states, start + input_ids.shape[1])

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embedding else n
