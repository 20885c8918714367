"""`megabam data prepare` throughput on a Parquet corpus: 1 and 2 workers against the tokenizer alone.

1. A Parquet corpus of --corpus-mb (Python stdlib sources, shuffled and repeated, 16 files, row groups
   of 1,000 documents) and a sentencepiece BPE of --vocab-size trained on a sample of it.
2. The tokenizer's own `encode` rate over the documents in memory (no reading, packing or writing).
3. `megabam data prepare --workers 1` and `--workers 2`, each as its own process, --rounds interleaved
   rounds: MiB/s and tokens/s (median and spread), and where the task time went (read, tokenize, pack,
   write; CPU-seconds summed over tasks).
4. Peak resident memory of a prepare (one worker, in process) of the corpus and of a quarter of it made
   of 4 files of the same size (so the same tasks, 4 times fewer): it should not grow with the input.

Run alone (two CPU jobs at once distort every figure):
    .venv/bin/python tools/bench_prepare.py   (prints Markdown tables)
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megabam.data.corpus import python_stdlib_documents  # noqa: E402
from megabam.data.tokenizer import open_tokenizer, train_tokenizer  # noqa: E402

FILES = 16


def write_corpus(folder: Path, texts: list[str], mb: float, files: int = FILES) -> tuple[int, int]:
    """`files` Parquet files of `mb` MiB of text in all; returns (bytes of text, bytes on disk)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    rng = random.Random(0)
    per_file, text = mb * 2**20 / files, 0
    for i in range(files):
        docs, size = [], 0
        while size < per_file:
            doc = rng.choice(texts)
            docs.append(doc)
            size += len(doc.encode())
        pq.write_table(pa.table({"text": docs}), folder / f"part-{i:03d}.parquet", row_group_size=1000)
        text += size
    return text, sum(p.stat().st_size for p in folder.iterdir())


def encode_rate(texts: list[str], tokenizer_path: Path, mb: float) -> tuple[float, float]:
    """(MiB/s, tokens/s) of the tokenizer's encode over about `mb` MiB of the documents, in memory."""
    tokenizer = open_tokenizer(tokenizer_path)
    sample, size = [], 0
    for text in texts:
        sample.append(text)
        size += len(text.encode())
        if size >= mb * 2**20:
            break
    start = time.perf_counter()
    tokens = sum(len(tokenizer.encode(t)) + 1 for t in sample)
    seconds = time.perf_counter() - start
    return size / 2**20 / seconds, tokens / seconds


def run_prepare(corpus: Path, out: Path, tokenizer: Path, workers: int, args) -> tuple[dict, float, int]:
    """(summary, wall seconds, peak RSS in KiB of the process tree) of one `megabam data prepare`."""
    cmd = [sys.executable, "-m", "megabam.cli", "data", "prepare", str(corpus), "--out", str(out)]
    cmd += ["--tokenizer", str(tokenizer), "--seq-len", str(args.seq_len), "--workers", str(workers)]
    cmd += ["--task-size", args.task_size, "--val-fraction", str(args.val_fraction), "--no-progress"]
    # A wrapper per run: RUSAGE_CHILDREN's peak covers only the processes this one waited for.
    wrapper = (
        "import resource, subprocess, sys, time\n"
        "t = time.perf_counter(); subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
        "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    done = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"prepare failed: {done.stderr[-2000:]}")
    wall, peak = done.stdout.split()
    meta = json.loads((out / "meta.json").read_text())
    return {**meta["summary"], "tasks": meta["tasks"]}, float(wall), int(peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-mb", type=float, default=200, help="Parquet corpus size (MiB of text)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of 1 and 2 workers")
    parser.add_argument(
        "--task-size", default="4mb", help="prepare's --task-size (default: a task per file, ~2.9 MB on disk each)"
    )
    parser.add_argument("--val-fraction", type=float, default=0.01)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="megabam-bench-prepare-") as tmp:
        tmp = Path(tmp)
        texts = python_stdlib_documents(20_000_000)
        random.Random(1).shuffle(texts)
        tokenizer = tmp / "tok.model"
        train_tokenizer(texts[:2000], tokenizer, args.vocab_size)
        text_bytes, on_disk = write_corpus(tmp / "big", texts, args.corpus_mb)
        write_corpus(tmp / "small", texts, args.corpus_mb / 4, FILES // 4)
        enc_mb_s, enc_tok_s = encode_rate(texts * 4, tokenizer, min(args.corpus_mb, 50))

        runs: dict[int, list[tuple[dict, float, int]]] = {1: [], 2: []}
        for r in range(args.rounds):
            for workers in (1, 2) if r % 2 == 0 else (2, 1):
                runs[workers].append(run_prepare(tmp / "big", tmp / f"out-{workers}-{r}", tokenizer, workers, args))
        small = run_prepare(tmp / "small", tmp / "out-small", tokenizer, 1, args)

        print(
            f"corpus: {FILES} Parquet files, {on_disk / 2**20:,.0f} MiB on disk, "
            f"{text_bytes / 2**20:,.0f} MiB of text; "
            f"{runs[1][0][0]['tokens']:,} tokens; sentencepiece BPE {args.vocab_size}; samples of {args.seq_len + 1}; "
            f"{runs[1][0][0]['tasks']} tasks of --task-size {args.task_size}\n"
        )
        print("| case | MiB/s (of Parquet input) | tokens/s | wall s | spread (min-max MiB/s) | ratio to 1 worker |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        medians = {}
        for workers in (1, 2):
            rates = [s["input_bytes"] / 2**20 / wall for s, wall, _ in runs[workers]]
            toks = [s["tokens"] / wall for s, wall, _ in runs[workers]]
            medians[workers] = statistics.median(rates)
            ratio = medians[workers] / medians[1]
            walls = statistics.median(w for _, w, _ in runs[workers])
            print(
                f"| prepare --workers {workers} | {medians[workers]:.2f} | {statistics.median(toks):,.0f} | "
                f"{walls:.1f} | {min(rates):.2f}-{max(rates):.2f} | {ratio:.2f} |"
            )
        print(f"| tokenizer encode alone (in memory) | {enc_mb_s:.2f} (of text) | {enc_tok_s:,.0f} | | | |")
        one = statistics.median(s["tokens"] / wall for s, wall, _ in runs[1])
        text_rate = medians[1] * text_bytes / on_disk
        print(
            f"\none worker takes {enc_tok_s / one:.2f}x the time of the tokenizer's encode alone (tokens/s); "
            f"projected per core: {100 * 2**10 / medians[1] / 3600:.1f} h per 100 GiB of this Parquet, "
            f"{100 * 2**10 / text_rate / 3600:.1f} h per 100 GiB of text ({text_rate:.2f} MiB/s of text)\n"
        )
        print("| stage (CPU-s summed over tasks, median round) | 1 worker | 2 workers |\n| --- | ---: | ---: |")
        for stage in ("read", "tokenize", "pack", "write"):
            cells = [statistics.median(s["stage_s"][stage] for s, _, _ in runs[w]) for w in (1, 2)]
            print(f"| {stage} | {cells[0]:.1f} | {cells[1]:.1f} |")
        print(
            "\n| peak resident memory, 1 worker | corpus | MiB |\n| --- | ---: | ---: |\n"
            f"| quarter corpus | {small[0]['input_bytes'] / 2**20:,.0f} MiB | {small[2] / 1024:,.0f} |\n"
            f"| full corpus | {runs[1][0][0]['input_bytes'] / 2**20:,.0f} MiB | "
            f"{max(p for _, _, p in runs[1]) / 1024:,.0f} |"
        )


if __name__ == "__main__":
    main()
