"""`megabam data inspect`: what a prepared dataset (or one MDS directory) holds."""

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megabam.data.errors import DataError
from megabam.data.shards import iter_mds_samples, read_index, verify_shards
from megabam.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_in
from megabam.progress import Progress


@dataclass
class SplitReport:
    """Figures of one MDS directory."""

    name: str
    shards: int
    samples: int
    tokens: int
    documents: int  # segments that start a document (carried-over segments excluded)
    min_id: int
    max_id: int
    distinct_ids: int
    top_ids: list[tuple[int, str | None, float]]  # (id, its piece if a tokenizer is known, share of tokens)
    decoded: list[str] = field(default_factory=list)


def inspect_dataset(
    path: str | Path,
    tokenizer_path: str | Path | None = None,
    vocab_size: int | None = None,
    n_decoded: int = 2,
    max_samples: int | None = None,
    top: int = 10,
) -> list[SplitReport]:
    """Verify the shards of ``path`` and summarise each split (``train``/``val``, or ``path`` itself).

    Shards are checked against their index (size, sha1) before reading; token ids at or above the
    vocabulary size (the tokenizer's, the one beside the splits, or ``vocab_size``)
    raise DataError. ``max_samples`` caps the samples read per split for the token statistics.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(path, None, "does not exist")
    splits = [path / s for s in ("train", "val") if (path / s / "index.json").exists()] or [path]
    if tokenizer_path is None:
        tokenizer_path = tokenizer_in(path)
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    vocab = vocab_size or (tokenizer.vocab_size if tokenizer else None)
    return [_inspect_split(d, tokenizer, vocab, n_decoded, max_samples, top) for d in splits]


def _inspect_split(
    mds_dir: Path, tokenizer: Tokenizer | None, vocab: int | None, n_decoded: int, max_samples: int | None, top: int
) -> SplitReport:
    n_shards = verify_shards(mds_dir, desc=f"inspect {mds_dir.name}: verifying")
    n_samples = sum(shard["samples"] for shard in read_index(mds_dir)["shards"])
    to_read = n_samples if max_samples is None else min(n_samples, max_samples)
    counts = np.zeros(vocab or 1, dtype=np.int64)
    tokens = documents = 0
    lo, hi = None, None
    decoded = []
    with Progress(f"inspect {mds_dir.name}: reading", to_read, " samples") as report:
        for i, sample in enumerate(report.iterate(iter_mds_samples(mds_dir, max_samples))):
            ids = np.asarray(sample["tokens"], dtype=np.int64)
            s_lo, s_hi = int(ids.min()), int(ids.max())
            if vocab is not None and (s_hi >= vocab or s_lo < 0):
                bad = s_hi if s_hi >= vocab else s_lo
                raise DataError(mds_dir, None, f"sample {i} holds token id {bad}, outside the vocabulary of {vocab}")
            lo = s_lo if lo is None else min(lo, s_lo)
            hi = s_hi if hi is None else max(hi, s_hi)
            if s_hi >= len(counts):
                counts = np.pad(counts, (0, s_hi + 1 - len(counts)))
            counts += np.bincount(ids, minlength=len(counts))
            tokens += len(ids)
            starts = sample["doc_starts"]
            documents += len(starts) - 1 + (i == 0)  # segment 0 continues a document, except in sample 0
            if tokenizer is not None and i < n_decoded:
                decoded.append(tokenizer.decode(ids.tolist()))
    order = np.argsort(-counts, kind="stable")[:top]
    top_ids = (
        [(int(t), tokenizer.decode([t]) if tokenizer else None, counts[t] / tokens) for t in order if counts[t] > 0]
        if tokens
        else []
    )
    return SplitReport(
        mds_dir.name,
        n_shards,
        n_samples,
        tokens,
        documents,
        lo or 0,
        hi or 0,
        int((counts > 0).sum()),
        top_ids,
        decoded,
    )


def report_lines(reports: list[SplitReport], width: int = 300) -> list[str]:
    """Human-readable lines for ``reports`` (decoded samples cut to ``width`` characters)."""
    lines = []
    for r in reports:
        lines += [
            f"== {r.name}",
            f"shards           {r.shards} (sizes and sha1 hashes verified)",
            f"samples          {r.samples:,}",
            f"tokens read      {r.tokens:,}   documents begun {r.documents:,}",
            f"token ids        {r.min_id} .. {r.max_id}, {r.distinct_ids:,} distinct",
            "most frequent    "
            + ", ".join(
                f"{i}{'' if piece is None else '=' + repr(piece)}: {share:.1%}" for i, piece, share in r.top_ids
            ),
        ]
        for k, text in enumerate(r.decoded):
            lines.append(f"sample {k}         {text[:width]!r}{' ...' if len(text) > width else ''}")
    return lines
