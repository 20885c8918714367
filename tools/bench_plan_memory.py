"""The planner's memory per GPU beside the trainer's measurement on CPU, as a table.

Each case is a `megabam train` of 3 steps with logging.track_memory=true (every tensor allocation of
step 2 counted, megabam/train/live_tensors.py) on the tiny BAM or SWAX config at the test suite's small
shape (d_model 64, 2 layers); the row shows the measured peak, the planner's prediction for the same
config and layout, and their ratio. tests/e2e/test_plan_memory.py checks a subset within 15 %.

    .venv/bin/python tools/bench_plan_memory.py
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers.runs import SMALL  # noqa: E402  (the tests' small shape, so the figures are the tests')

CASES = [
    ("tiny_cpu", []),
    ("tiny_cpu", ["data.seq_len=512"]),
    ("tiny_cpu", ["data.seq_len=512", "train.micro_batch_size=16"]),
    ("tiny_cpu", ["data.seq_len=1024", "train.micro_batch_size=2"]),
    ("tiny_cpu", ["data.seq_len=512", "parallel.recompute=selective"]),
    ("tiny_cpu", ["data.seq_len=512", "parallel.recompute=full"]),
    ("swax_tiny_cpu", []),
    ("swax_tiny_cpu", ["data.seq_len=512"]),
    ("swax_tiny_cpu", ["data.seq_len=512", "train.micro_batch_size=16"]),
    ("swax_tiny_cpu", ["data.seq_len=1024", "train.micro_batch_size=2"]),
    ("swax_tiny_cpu", ["data.seq_len=512", "parallel.recompute=selective"]),
    ("swax_tiny_cpu", ["data.seq_len=512", "parallel.recompute=full"]),
]


def main() -> None:
    print("| config | overrides (on the tests' small shape) | measured MiB | predicted MiB | predicted / measured |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (config, overrides) in enumerate(CASES):
            run = [f"run.output_dir={tmp}", f"data.cache_dir={tmp}/cache", *SMALL, f"run.name=r{i}", "train.steps=3"]
            cmd = [sys.executable, "-m", "megabam.cli", "train", str(ROOT / "yaml_configs" / f"{config}.yaml")]
            cmd += [*run, "logging.track_memory=true", *overrides]
            subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
            rows = [json.loads(x) for x in Path(tmp, f"r{i}", "metrics.jsonl").read_text().splitlines()]
            (row,) = [r for r in rows if "peak_memory_mib" in r]
            measured, predicted = row["peak_memory_mib"], row["predicted_memory_mib"]
            shown = " ".join(overrides) or "(seq 128, micro-batch 4)"
            print(f"| {config} | {shown} | {measured:.1f} | {predicted:.1f} | {predicted / measured:.2f} |", flush=True)


if __name__ == "__main__":
    main()
