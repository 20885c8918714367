"""Data loader throughput: `build_loader` samples/s against what training consumes.

`build_loader` over --loader-samples samples of --seq-len+1 random tokens (zstd shards, shuffled) with 0
and 2 loader workers, micro-batch 1, against what one GPU consumes training 7B at 16k. (`data prepare`
throughput: tools/bench_prepare.py.)

Run: .venv/bin/python tools/bench_data.py   (prints a Markdown table)
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megabam.data.loader import build_loader  # noqa: E402
from megabam.data.packing import PackedSample  # noqa: E402
from megabam.data.shards import write_mds  # noqa: E402
from megabam.data.streaming_import import import_streaming  # noqa: E402


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
    parser.add_argument("--seq-len", type=int, default=16384, help="loader sample length (7B@16k)")
    parser.add_argument("--loader-samples", type=int, default=400)
    args = parser.parse_args()

    import_streaming()  # its import (~2 s) would otherwise be charged to whichever case runs first
    with tempfile.TemporaryDirectory(prefix="megabam-bench-") as tmp:
        tmp = Path(tmp)
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
