"""The decoder and its layer types (pure PyTorch, no parallel code)."""

from megabam.model.transformer import MIXERS, Decoder, DecoderState

__all__ = ["Decoder", "DecoderState", "MIXERS"]
