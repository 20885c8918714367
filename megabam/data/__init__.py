"""Data path: a corpus, a sentencepiece tokenizer, passkey samples, packing, MDS shards, loaders.

Each step lives in its own module so a later ``data prepare`` command can reuse them one by one;
``default_dataset`` chains them into the trunk's default training data.
"""
