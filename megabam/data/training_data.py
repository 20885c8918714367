"""What the trainer reads: train and validation streams plus the tokenizer, checked against the model."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megabam.config import Config, ConfigError
from megabam.data.default_dataset import build_default_dataset
from megabam.data.errors import DataError
from megabam.data.mixture import StreamSpec, check_streams
from megabam.data.passkey import PromptTooShort, TrainingPasskeys
from megabam.data.shards import verify_shards
from megabam.data.tokenizer import load_tokenizer


@dataclass
class TrainingData:
    """Streams for ``build_loader`` (training mixture, validation) and the tokenizer's path."""

    train: list[StreamSpec]
    val: list[StreamSpec]
    tokenizer_path: Path


def single_dataset(train_dir: Path, val_dir: Path, tokenizer_path: Path) -> TrainingData:
    """One MDS directory per split (the default dataset's layout)."""
    return TrainingData([StreamSpec(str(train_dir))], [StreamSpec(str(val_dir))], Path(tokenizer_path))


def prepared_mixture(
    streams,
    tokenizer_path: str | Path,
    vocab_size: int,
    seq_len: int,
    verify_hashes: bool = False,
    validation: bool = True,
) -> TrainingData:
    """Training data from prepared datasets (objects with ``path``, ``remote``, ``weight``, ``repeat``).

    Refuses (DataError) a tokenizer whose size is not ``vocab_size``, a local dataset written for
    another sequence length or vocabulary (its ``meta.json``) or with a missing or truncated shard (or,
    with ``verify_hashes``, a local shard whose sha1 differs from its index). Validation reads every stream's
    ``val`` split once, unweighted, leaving out local ones that hold no sample; with ``validation``
    off (train.eval_batches=0) a mixture without any validation sample is accepted.
    """
    load_tokenizer(tokenizer_path, vocab_size)
    train, val = [], []
    for i, s in enumerate(streams):
        meta_path = Path(s.path) / "meta.json"
        meta = json.loads(meta_path.read_text()) if s.remote is None and meta_path.exists() else None
        if meta is not None and meta["seq_len"] != seq_len:
            raise DataError(
                s.path, "data.seq_len", f"{seq_len}, but stream {i} was prepared for seq_len {meta['seq_len']}"
            )
        if meta is not None and meta["vocab_size"] != vocab_size:
            raise DataError(
                s.path,
                "model.vocab_size",
                f"{vocab_size}, but stream {i} was tokenized with {meta['vocab_size']} pieces",
            )
        if s.remote is None:
            if not (Path(s.path) / "train" / "index.json").exists():
                raise DataError(
                    s.path,
                    f"data.streams[{i}]",
                    "not a prepared dataset (no train/index.json); training reads what "
                    f"`megabam data prepare {s.path} --out DIR --tokenizer {tokenizer_path} --seq-len {seq_len}` "
                    "writes (from text, JSON Lines, Parquet, Arrow or a datasets folder)",
                )
            # Streaming checks hashes only when it downloads; a local shard cut short by a failed copy
            # is caught here by its size (cheap: no shard is read), a bit flip only by hashing it all.
            for split in ("train", "val"):
                verify_shards(Path(s.path) / split, hashes=verify_hashes)
        train.append(StreamSpec(s.path, s.remote, "train", s.weight, s.repeat))
        if meta is None or meta["summary"]["samples"]["val"] > 0:
            val.append(StreamSpec(s.path, s.remote, "val"))
    check_streams(train)
    if not val and validation:
        raise DataError(
            "<data>",
            "data.streams",
            "no stream has validation samples (prepare with --val-fraction > 0, or synth with --val; "
            "train.eval_batches=0 trains without validation)",
        )
    return TrainingData(train, val, Path(tokenizer_path))


def build_training_data(cfg: Config, rank: int) -> TrainingData:
    """Streams and tokenizer of the run. data.source=default: rank 0 builds (or finds cached) the
    default dataset, the others then read the cache. data.source=mds: the prepared datasets of
    data.streams, refused (ConfigError) if the tokenizer or the datasets disagree with the config."""
    if cfg.data.source == "mds":
        try:
            return prepared_mixture(
                cfg.data.streams,
                cfg.data.tokenizer,
                cfg.model.vocab_size,
                cfg.data.seq_len,
                verify_hashes=cfg.data.verify_hashes,
                validation=cfg.train.eval_batches > 0,
            )
        except DataError as e:
            raise ConfigError("<config>", "data", str(e)) from None
    cache_root = data_cache(cfg.data.cache_dir)

    def build():
        try:
            return build_default_dataset(
                cache_root,
                sample_len=cfg.data.seq_len + 1,
                vocab_size=cfg.model.vocab_size,
                corpus_bytes=cfg.data.corpus_bytes,
                passkey_fraction=cfg.data.passkey_fraction,
                passkey_min_tokens=cfg.data.passkey_min_tokens,
                passkey_style=TrainingPasskeys(
                    filler=cfg.data.passkey_filler,
                    key_digits=tuple(cfg.data.passkey_key_digits),
                    answer_end=cfg.data.passkey_answer_end,
                ),
                val_fraction=cfg.data.val_fraction,
                seed=cfg.run.seed,
            )
        except PromptTooShort:
            if cfg.data.passkey_min_tokens is not None:
                raise ConfigError(
                    "<config>",
                    "data.passkey_min_tokens",
                    f"{cfg.data.passkey_min_tokens} tokens cannot hold a passkey document; lengthen it",
                ) from None
            raise ConfigError(
                "<config>",
                "data.seq_len",
                f"{cfg.data.seq_len} tokens cannot hold the default data's passkey documents "
                f"(data.passkey_fraction={cfg.data.passkey_fraction}); lengthen it or set the fraction to 0",
            ) from None
        except RuntimeError as e:  # sentencepiece refuses this vocabulary size on the corpus
            raise ConfigError(
                "<config>",
                "model.vocab_size",
                f"the default corpus cannot train a tokenizer of {cfg.model.vocab_size} "
                f"pieces ({str(e).splitlines()[0][-160:]})",
            ) from None

    data = build() if rank == 0 else None
    dist.barrier()
    data = data if data is not None else build()
    return single_dataset(data.train_dir, data.val_dir, data.tokenizer_path)


def data_cache(cache_dir: str | None) -> Path:
    """Where the default dataset is built: data.cache_dir, else $MEGABAM_CACHE, else ~/.cache/megabam."""
    return Path(cache_dir or os.environ.get("MEGABAM_CACHE") or "~/.cache/megabam").expanduser()
