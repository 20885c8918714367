"""`megabam data synth`: a prepared dataset of synthetic retrieval samples, for training mixtures.

Each sample is one whole document (prompt, answer, eos) of exactly ``seq_len + 1`` tokens, in the
same layout as ``prepare`` writes (train/, val/, the tokenizer, meta.json), so it can be named as
a stream of a mixture next to text datasets.
"""

import json
import random
from pathlib import Path

import numpy as np

from megabam.data.errors import DataError
from megabam.data.niah import VARIANTS, niah_sample
from megabam.data.packing import PackedSample
from megabam.data.passkey import passkey_training_tokens
from megabam.data.shards import open_mds_writer, write_sample
from megabam.data.tokenizer import Tokenizer, copy_tokenizer, load_tokenizer
from megabam.progress import Progress
from megabam.staging import check_output, staged_folder

KINDS = ("passkey", *(f"niah_{v}" for v in VARIANTS))


def synthetic_tokens(
    kind: str, tokenizer: Tokenizer, n_tokens: int, rng: random.Random, essay: str | None = None
) -> list[int]:
    """One ``kind`` training document of ``n_tokens`` tokens (prompt then answer), random depth and key."""
    if kind == "passkey":
        return passkey_training_tokens(tokenizer, n_tokens, rng)
    variant = kind.removeprefix("niah_")
    depth = rng.random()
    # The answer's length is known only once the value is drawn: draw once to measure it, then
    # redraw the same key and value (same RNG state) with the prompt shortened by that much.
    state = rng.getstate()
    answer_len = len(niah_sample(tokenizer, n_tokens, depth, variant, rng, essay).answer_ids)
    rng.setstate(state)
    sample = niah_sample(tokenizer, n_tokens - answer_len, depth, variant, rng, essay)
    return sample.prompt_ids + sample.answer_ids


def write_synthetic_dataset(
    kind: str,
    out: str | Path,
    tokenizer_path: str | Path,
    seq_len: int,
    n_train: int,
    n_val: int,
    seed: int = 0,
    essay_path: str | Path | None = None,
    overwrite: bool = False,
) -> dict[str, int]:
    """Write ``n_train`` + ``n_val`` ``kind`` samples of ``seq_len + 1`` tokens to ``out``; return counts."""
    if kind not in KINDS:
        raise DataError(None, "--kind", f"unknown synthetic kind {kind!r} (known: {', '.join(KINDS)})")
    if n_train < 1 or n_val < 0:
        raise DataError(
            None, "--train", f"need at least one training sample and no negative count, got {n_train} and {n_val}"
        )
    tokenizer = load_tokenizer(tokenizer_path)
    essay = Path(essay_path).read_text() if essay_path else None  # None: the essay variants' default prose
    rng = random.Random(seed)
    check_output(Path(out), overwrite)
    with staged_folder(Path(out), replace=overwrite) as tmp, Progress("synth", n_train + n_val, " samples") as report:
        for split, n in (("train", n_train), ("val", n_val)):
            writer = open_mds_writer(tmp / split, compression=None)
            for _ in range(n):
                try:
                    # the eos closes the document: seq_len tokens of prompt and answer, then eos
                    tokens = synthetic_tokens(kind, tokenizer, seq_len, rng, essay) + [tokenizer.eos_id]
                except ValueError as e:
                    raise DataError(None, "--seq-len", f"{kind} at {seq_len} tokens: {e}") from None
                write_sample(writer, PackedSample(np.array(tokens, dtype=np.int32), np.zeros(1, dtype=np.int32)))
                report.advance()
            writer.finish()
        copy_tokenizer(tokenizer, tmp)
        meta = {
            "seq_len": seq_len,
            "sample_len": seq_len + 1,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "synthetic": kind,
            "summary": {"samples": {"train": n_train, "val": n_val}},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return {"train": n_train, "val": n_val}
