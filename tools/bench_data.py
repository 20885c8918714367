"""Data pipeline throughput: `prepare` tokens/s against a plain loop, loader samples/s against training.

1. A JSON Lines corpus (Python stdlib sources, repeated to --corpus-mb) and a sentencepiece BPE.
2. The single-process reference: read lines, json.loads, encode, pack, write MDS, one after the other.
3. `prepare_dataset` with 1 and 2 tokenizer workers (the main process reads, packs and writes).
4. `build_loader` over --loader-samples samples of --seq-len+1 random tokens (zstd shards, shuffled)
   with 0 and 2 loader workers, micro-batch 1, against what one GPU consumes training 7B at 16k.

Run: .venv/bin/python tools/bench_data.py   (prints a Markdown table)
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megabam.data.corpus import python_stdlib_documents  # noqa: E402
from megabam.data.loader import build_loader  # noqa: E402
from megabam.data.packing import PackedSample, pack_documents  # noqa: E402
from megabam.data.prepare import prepare_dataset  # noqa: E402
from megabam.data.shards import write_mds  # noqa: E402
from megabam.data.streaming_import import import_streaming  # noqa: E402
from megabam.data.tokenizer import Tokenizer, train_tokenizer  # noqa: E402


def reference_loop(corpus: Path, tokenizer_path: Path, seq_len: int, out: Path) -> tuple[int, float]:
    """The plain single-process pipeline: (tokens, seconds)."""
    start = time.perf_counter()
    tokenizer = Tokenizer(tokenizer_path)
    counted = [0]

    def docs():
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                if not text:  # prepare skips empty documents too
                    continue
                ids = tokenizer.encode(text)
                counted[0] += len(ids) + 1
                yield ids

    write_mds(pack_documents(docs(), seq_len + 1, tokenizer.eos_id), out, size_limit="64mb")
    return counted[0], time.perf_counter() - start


def loader_rate(data_dir: Path, workers: int, n_samples: int) -> float:
    """Samples per second over one shuffled epoch, micro-batch 1."""
    import_streaming().base.util.clean_stale_shared_memory()
    loader = build_loader(
        data_dir, micro_batch_size=1, shuffle=True, seed=0, num_workers=workers, prefetch_factor=4 if workers else None
    )
    start = time.perf_counter()
    count = sum(batch["input_ids"].shape[0] for batch in loader)
    assert count == n_samples
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-mb", type=float, default=16, help="JSON Lines corpus size")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--prepare-seq-len", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=16384, help="loader sample length (7B@16k)")
    parser.add_argument("--loader-samples", type=int, default=400)
    args = parser.parse_args()

    import_streaming()  # its import (~2 s) would otherwise be charged to whichever case runs first
    with tempfile.TemporaryDirectory(prefix="megabam-bench-") as tmp:
        tmp = Path(tmp)
        texts = python_stdlib_documents(5_000_000)
        corpus = tmp / "corpus.jsonl"
        with open(corpus, "w", encoding="utf-8") as f:
            while f.tell() < args.corpus_mb * 1e6:
                for text in texts:
                    f.write(json.dumps({"text": text}) + "\n")
        tok = tmp / "tok.model"
        train_tokenizer(texts, tok, args.vocab_size)
        size_mb = corpus.stat().st_size / 1e6

        rows = []
        tokens, seconds = reference_loop(corpus, tok, args.prepare_seq_len, tmp / "ref")
        rows.append(("reference loop (1 process)", tokens / seconds, seconds))
        for workers in (1, 2):
            summary = prepare_dataset(
                [str(corpus)], tmp / f"prep{workers}", tok, args.prepare_seq_len, workers=workers, val_fraction=0.01
            )
            assert summary.tokens == tokens
            rows.append((f"prepare --workers {workers}", summary.tokens_per_s, summary.seconds))
        print(
            f"corpus {size_mb:.1f} MB JSON Lines, {tokens:,} tokens, vocab {args.vocab_size}, "
            f"samples of {args.prepare_seq_len + 1} tokens, {os.cpu_count()} cores\n"
        )
        print("| prepare | tokens/s | seconds |\n| --- | ---: | ---: |")
        for name, rate, secs in rows:
            print(f"| {name} | {rate:,.0f} | {secs:.1f} |")

        rng = np.random.default_rng(0)
        sample_len = args.seq_len + 1
        samples = (
            PackedSample(rng.integers(0, 32000, sample_len, dtype=np.int32), np.array([0], dtype=np.int32))
            for _ in range(args.loader_samples)
        )
        write_mds(samples, tmp / "long", size_limit="64mb")
        print(
            f"\n| loader ({args.loader_samples} samples of {sample_len} tokens, zstd shards, shuffled) | samples/s |"
            "\n| --- | ---: |"
        )
        for workers in (0, 2):
            print(f"| num_workers={workers} | {loader_rate(tmp / 'long', workers, args.loader_samples):,.1f} |")


if __name__ == "__main__":
    main()
