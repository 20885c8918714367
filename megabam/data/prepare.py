"""`megabam data prepare`: text inputs → tokens (worker processes) → packed samples → MDS shards.

The output directory holds ``train/`` and ``val/`` (MDS datasets, one StreamingDataset ``split``
each), ``tokenizer.model`` (a copy of the tokenizer used) and ``meta.json`` (sequence length,
vocab size, the summary). Documents, not samples, are assigned to train or validation, so no
document straddles the two.
"""

import json
import multiprocessing
import random
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from megabam.data.errors import DataError
from megabam.data.output_dir import check_output, staged_output
from megabam.data.packing import Packer
from megabam.data.shards import open_mds_writer, write_sample
from megabam.data.sources import SourceStats, expand_inputs, read_documents
from megabam.data.tokenizer import Tokenizer, load_tokenizer

SPLITS = ("train", "val")
# Documents per task sent to a tokenizer worker: large enough to amortise pickling, small enough
# that the progress bar moves and memory stays flat.
_CHUNK_DOCS = 256
# Fewer validation samples than this draws a warning: one evaluation of the trainer's defaults
# (train.eval_batches 8 × train.micro_batch_size 8) on one data-parallel rank. Training refuses a
# split smaller than one micro-batch per rank, rather than logging a val loss of NaN.
MIN_VAL_SAMPLES = 64


@dataclass
class PrepareSummary(SourceStats):
    """What one ``prepare`` run read (the reader's counts, filled in directly) and wrote."""

    long_documents_split: int = 0
    tokens: int = 0
    tokens_dropped: int = 0
    samples: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SPLITS})
    shards: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SPLITS})
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def lines(self) -> list[str]:
        val = self.samples["val"]
        warn = [
            f"warning: the validation split has {val} samples, under {MIN_VAL_SAMPLES} (the trainer's default "
            "evaluation on one rank); raise --val-fraction, or train with train.eval_batches sized to it"
        ]
        return [
            f"files            {self.files:,}",
            f"documents        {self.documents:,} (empty skipped {self.empty_skipped:,}, "
            f"non-UTF-8 replaced {self.bad_utf8:,}, longer than a sample and split {self.long_documents_split:,})",
            f"tokens           {self.tokens:,} with eos ({self.tokens_dropped:,} dropped in final partial samples)",
            f"samples          train {self.samples['train']:,}, val {self.samples['val']:,}",
            f"shards           train {self.shards['train']:,}, val {self.shards['val']:,}",
            f"time             {self.seconds:.1f} s ({self.tokens_per_s:,.0f} tokens/s)",
            *(warn if 0 < val < MIN_VAL_SAMPLES else []),
        ]


def prepare_dataset(
    inputs: list[str],
    out: str | Path,
    tokenizer_path: str | Path,
    seq_len: int,
    *,
    text_field: str = "text",
    text_unit: str = "file",
    on_bad_utf8: str = "fail",
    workers: int = 1,
    val_fraction: float = 0.01,
    seed: int = 0,
    compression: str | None = "zstd",
    size_limit: int | str = "64mb",
    overwrite: bool = False,
    progress: bool = False,
) -> PrepareSummary:
    """Tokenize ``inputs`` and write packed ``seq_len + 1``-token samples as MDS shards in ``out``.

    Each document is followed by the tokenizer's eos; a document longer than a sample continues
    into the next (counted in the summary). ``workers`` tokenizer processes (0 = tokenize in this
    process). ``out`` appears only when complete; an existing ``out`` is refused unless
    ``overwrite``. Bad input raises DataError with a one-line message.
    """
    out = Path(out)
    if seq_len < 1:
        raise DataError(f"seq_len must be at least 1, got {seq_len}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val fraction must lie in [0, 1), got {val_fraction}")
    check_output(out, overwrite)
    paths = expand_inputs(inputs)
    tokenizer = load_tokenizer(tokenizer_path)
    sample_len = seq_len + 1
    summary = PrepareSummary()
    start = time.perf_counter()
    docs = read_documents(paths, text_field=text_field, text_unit=text_unit, on_bad_utf8=on_bad_utf8, stats=summary)
    bar = _progress_bar(progress)
    with staged_output(out, overwrite) as tmp:
        writers = {s: open_mds_writer(tmp / s, compression, size_limit) for s in SPLITS}
        packers = {s: Packer(sample_len, tokenizer.eos_id) for s in SPLITS}
        rng = random.Random(seed)
        try:
            for tokens in _encode(docs, tokenizer.path, workers):
                split = "val" if rng.random() < val_fraction else "train"
                summary.tokens += len(tokens) + 1
                summary.long_documents_split += len(tokens) + 1 > sample_len
                for sample in packers[split].add(tokens):
                    write_sample(writers[split], sample)
                    summary.samples[split] += 1
                if bar is not None:
                    bar.update(len(tokens) + 1)
        except BaseException:
            for writer in writers.values():
                writer.cancel_future_jobs()
            raise
        finally:
            if bar is not None:
                bar.close()
        if summary.documents == 0:
            raise DataError(f"inputs {' '.join(inputs)} hold no non-empty document")
        summary.tokens_dropped = sum(p.pending for p in packers.values())
        for split in SPLITS:
            writers[split].finish()
            summary.shards[split] = len(json.loads((tmp / split / "index.json").read_text())["shards"])
        if summary.samples["train"] == 0:
            raise DataError(f"{summary.tokens:,} tokens fill no training sample of {sample_len} tokens")
        if val_fraction > 0 and summary.samples["val"] == 0:
            raise DataError(f"no validation sample of {sample_len} tokens came out; raise --val-fraction or add data")
        summary.seconds = time.perf_counter() - start
        shutil.copyfile(tokenizer.path, tmp / "tokenizer.model")
        meta = {
            "seq_len": seq_len,
            "sample_len": sample_len,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "inputs": list(inputs),
            "summary": asdict(summary),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return summary


def _encode(docs: Iterable[str], tokenizer_path: Path, workers: int) -> Iterator[list[int] | np.ndarray]:
    """Token ids of each document, in input order, from ``workers`` processes (0 = here)."""
    if workers == 0:
        tokenizer = Tokenizer(tokenizer_path)
        for doc in docs:
            yield tokenizer.encode(doc)
        return
    # spawn, not fork: the parent may hold threads (tqdm's monitor, streaming's writers).
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer_path),)) as pool:
        # A bounded window of chunks in flight, taken in input order: every worker stays busy
        # while memory stays flat (Pool.imap would read the whole input ahead).
        in_flight: deque = deque()
        for chunk in _chunks(docs, _CHUNK_DOCS):
            in_flight.append(pool.apply_async(_encode_chunk, (chunk,)))
            if len(in_flight) >= 4 * workers:
                yield from in_flight.popleft().get()
        while in_flight:
            yield from in_flight.popleft().get()


_worker_tokenizer: Tokenizer | None = None


def _init_worker(path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(path)


def _encode_chunk(texts: list[str]) -> list[np.ndarray]:
    # int32 arrays travel back to the parent as raw bytes; lists of Python ints pickle ~10x slower.
    return [np.array(_worker_tokenizer.encode(t), dtype=np.int32) for t in texts]


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _progress_bar(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(desc="prepare", unit=" tok", unit_scale=True, file=sys.stderr, disable=None)  # None: tty only
