"""Data path: a corpus, a sentencepiece tokenizer, passkey samples, packing, MDS shards, loaders.

Each step lives in its own module; ``default_dataset`` chains them into the trunk's default training
data, ``prepare`` / ``synth`` / ``inspect_data`` into the ``megabam data`` commands (``cli``), and
``training_data`` / ``mixture`` / ``loader`` feed the trainer (docs/design.md, "Data flow").
"""
