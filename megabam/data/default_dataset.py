"""The trunk's default training data, built offline on any machine and cached.

Python standard-library sources (real text every Python install ships) mixed with synthetic
passkey documents, tokenized by a sentencepiece model trained on the same sources, packed and
written as MDS shards.
"""

import hashlib
import json
import logging
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from megabam.data.corpus import python_stdlib_documents
from megabam.data.packing import PackedSample, pack_documents
from megabam.data.passkey import TrainingPasskeys, passkey_training_tokens
from megabam.data.shards import write_mds
from megabam.data.tokenizer import train_tokenizer
from megabam.staging import staged_name

log = logging.getLogger(__name__)

# Bump when the recipe changes, so caches built by older code are not reused.
_RECIPE_VERSION = 2


@dataclass
class DefaultDataset:
    """Where a built default dataset lives."""

    train_dir: Path
    val_dir: Path
    tokenizer_path: Path


def build_default_dataset(
    cache_root: Path,
    *,
    sample_len: int,
    vocab_size: int,
    corpus_bytes: int,
    passkey_fraction: float,
    val_fraction: float,
    seed: int,
    passkey_min_tokens: int | None = None,
    passkey_style: TrainingPasskeys = TrainingPasskeys(),
) -> DefaultDataset:
    """Build (or reuse from ``cache_root``) the default dataset.

    The cache key hashes the arguments and the Python version (the corpus is its stdlib). The
    dataset is built in a temporary directory and renamed into place; a concurrent builder that
    loses the rename uses the winner's copy. Passkey documents are never split across samples (needle
    and question are always seen together): each fills one whole sample with its eos, or, with
    ``passkey_min_tokens``, a sample holds several of random lengths (`passkey_samples`). Passkey
    samples make up about ``passkey_fraction`` of the samples, their documents in ``passkey_style``
    (`TrainingPasskeys`: filler, key lengths, what ends the answer). Samples are split by
    ``val_fraction`` (at least one validation sample).
    """
    if not 0.0 <= passkey_fraction < 1.0:
        raise ValueError(f"passkey_fraction must lie in [0, 1), got {passkey_fraction}")
    build = dict(
        sample_len=sample_len,
        vocab_size=vocab_size,
        corpus_bytes=corpus_bytes,
        passkey_fraction=passkey_fraction,
        passkey_min_tokens=passkey_min_tokens,
        passkey_style=passkey_style,
        val_fraction=val_fraction,
        seed=seed,
    )
    args = build | dict(passkey_style=asdict(passkey_style), python=sys.version, recipe=_RECIPE_VERSION)
    digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:16]
    final = Path(cache_root) / f"default-{digest}"
    if not final.exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = staged_name(final)
        try:
            write_default_dataset(tmp, **build)
            os.rename(tmp, final)
        except OSError:
            if not final.exists():  # a failure of our own, not a lost race
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return DefaultDataset(final / "train", final / "val", final / "tokenizer.model")


def write_default_dataset(
    out,
    sample_len,
    vocab_size,
    corpus_bytes,
    passkey_fraction,
    val_fraction,
    seed,
    passkey_min_tokens=None,
    passkey_style=TrainingPasskeys(),
):
    """Train the tokenizer and write the train/val shards of the default dataset into `out` (created here)."""
    start = time.perf_counter()

    def progress(message):
        log.info(f"[default dataset {time.perf_counter() - start:5.1f}s] {message}")

    out.mkdir()
    texts = python_stdlib_documents(corpus_bytes)
    progress(f"{len(texts)} stdlib documents, {sum(map(len, texts))} characters")
    tokenizer = train_tokenizer(texts, out / "tokenizer.model", vocab_size)
    progress(f"tokenizer trained, {tokenizer.vocab_size} pieces")
    docs = tokenizer.encode_batch(texts)
    text_tokens = sum(len(d) + 1 for d in docs)
    progress(f"{text_tokens} text tokens")

    # Text is packed as one stream; each passkey document is a sample of its own, k of them making
    # passkey_fraction of the samples: k / (n_text + k) = passkey_fraction.
    samples = list(pack_documents(docs, sample_len, tokenizer.eos_id))
    rng = random.Random(seed)
    n_passkey = round(passkey_fraction * len(samples) / (1.0 - passkey_fraction))
    samples += [
        passkey_samples(tokenizer, sample_len, passkey_min_tokens, rng, passkey_style) for _ in range(n_passkey)
    ]
    rng.shuffle(samples)
    progress(f"{n_passkey} passkey samples")

    n_val = max(1, round(val_fraction * len(samples)))
    if n_val >= len(samples):
        raise ValueError(f"{len(samples)} samples leave none for training after {n_val} for val")
    # Uncompressed: streaming decompresses local zstd shards into the dataset directory on first
    # read, which would make the shared cache mutable (and racy between concurrent jobs).
    n_train = write_mds(samples[:-n_val], out / "train", compression=None)
    write_mds(samples[-n_val:], out / "val", compression=None)
    progress(f"{n_train} train and {n_val} val samples of {sample_len} tokens written")


def passkey_samples(
    tokenizer,
    sample_len: int,
    min_tokens: int | None,
    rng: random.Random,
    style: TrainingPasskeys = TrainingPasskeys(),
) -> PackedSample:
    """One sample of whole passkey documents, each with its eos: one filling it (min_tokens None), or
    several, each min_tokens..sample_len - 1 tokens long but the last, which takes the rest."""
    tokens: list[int] = []
    starts: list[int] = []
    room = sample_len
    while room:
        n = room if min_tokens is None else rng.randint(min_tokens + 1, sample_len)
        if room - n < (min_tokens or 0) + 1:  # no room left for another document: this one takes it all
            n = room
        starts.append(len(tokens))
        tokens += passkey_training_tokens(tokenizer, n - 1, rng, style) + [tokenizer.eos_id]
        room -= n
    return PackedSample(np.array(tokens, dtype=np.int32), np.array(starts, dtype=np.int32))
