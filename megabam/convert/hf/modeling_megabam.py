"""An exported megabam model for transformers (shipped inside the export; runs without megabam).

The model is megabam's own `Decoder`, from the megabam sources bundled in this folder (the files named
megabam_*.py, copies with their imports made relative), so the export computes exactly what megabam
computes: every positional scheme and SSMax, sliding-window attention, mLSTM and Gated DeltaNet.
Its ops run in mode `reference` (the PyTorch forms; the Triton kernels stay in megabam).

Generation keeps `Decoder.stream`'s state as its cache (`MegabamCache`): the KV cache of full-attention
layers, the ring of the last `window` keys and values of sliding-window layers, the fixed-size state
of mLSTM and Gated DeltaNet layers, so a SWA + mLSTM model generates in memory that does not grow
with the context. Batches generate without padding (an attention_mask with zeros is refused).
"""

import dataclasses
import typing

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_megabam import MegabamConfig
from .megabam_config_schema import ModelConfig
from .megabam_model_transformer import Decoder

# (generated: the other bundled modules, imported so that transformers copies each of them)

# transformers 5 renamed the cache of model outputs and generation kwargs from `past_key_values` to
# `cache` (the old name still works there, with a deprecation warning); use what this version names it.
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _build(cls, raw: dict):
    """A megabam config dataclass from its dict (values as megabam validated and wrote them)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        value = raw[f.name]
        values[f.name] = _build(hints[f.name], value) if dataclasses.is_dataclass(hints[f.name]) else value
    return cls(**values)


class MegabamCache:
    """What generation carries between steps: `Decoder.stream`'s state (`DecoderState`)."""

    def __init__(self, state=None):
        self.state = state

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.state is None else self.state.length


class MegabamForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MegabamConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True  # the cache is megabam's own state, not a transformers Cache
    _no_split_modules = ["Block"]
    _supports_cache_class = False

    def __init__(self, config: MegabamConfig):
        super().__init__(config)
        model_config = _build(ModelConfig, {**config.megabam, "kernels": "reference"})
        self.model = Decoder(model_config)
        self.post_init()

    def _init_weights(self, module):
        # Decoder initialises its weights itself and from_pretrained loads every one of them; what
        # checkpoints do not hold (ALiBi's fixed slopes) is set again once transformers has
        # materialised a model it built on the meta device (transformers 5 does).
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return None  # tied embeddings are the Decoder's own (it reads embed.weight), or its lm_head

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits (and the mean next-token loss of `labels`); with a cache or use_cache, the tokens
        continue the cached stream (`Decoder.stream`) and the output carries the new cache."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("megabam models take no padding: every attention_mask entry must be 1")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if use_cache or cache is not None:
            logits, state = self.model.stream(input_ids, cache.state if isinstance(cache, MegabamCache) else None)
            cache = MegabamCache(state)
        else:
            logits = self.model(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE: cache})

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, MegabamCache) and cache.state is not None:
            input_ids = input_ids[:, cache.get_seq_length() :]  # only the tokens not yet streamed
        else:
            cache = MegabamCache()
        return {"input_ids": input_ids, CACHE: cache, "use_cache": True}
