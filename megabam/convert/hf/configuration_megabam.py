"""The configuration of an exported megabam model (shipped inside the export; imports only transformers).

`megabam` holds the model section of the megabam config that trained it (megabam/config/schema.py
ModelConfig, as a dict); the usual transformers names are set from it for tools that read them.
"""

from transformers import PretrainedConfig


class MegabamConfig(PretrainedConfig):
    model_type = "megabam"

    def __init__(self, megabam: dict | None = None, **kwargs):
        self.megabam = megabam or {}
        m = self.megabam
        kwargs.setdefault("tie_word_embeddings", m.get("tie_embeddings", True))
        super().__init__(**kwargs)
        self.vocab_size = m.get("vocab_size")
        self.hidden_size = m.get("d_model")
        self.num_hidden_layers = m.get("n_layers")
        self.num_attention_heads = m.get("n_heads")
