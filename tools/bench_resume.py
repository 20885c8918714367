"""Checkpoint save/load time and size, and SIGTERM-to-exit time, for a config (default: tiny_cpu).

Runs `megabam train` as subprocesses in a temporary directory:
  1. N steps with a checkpoint every N/2 steps → save time (from metrics.jsonl) and size on disk;
  2. the same run with one more step → auto-resume, load time (from the "loaded in" line);
  3. a long run, SIGTERM after a few steps → seconds from the signal to the process's exit (75).
Usage: .venv/bin/python tools/bench_resume.py [--config yaml_configs/tiny_cpu.yaml] [--steps 20]
"""

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train_cmd(config: str, root: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megabam.cli",
        "train",
        config,
        f"run.output_dir={root}",
        "run.name=bench",
        "logging.progress_bar=false",
        "eval.passkey_samples=0",
        "logging.log_every=1",
        *overrides,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "yaml_configs" / "tiny_cpu.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        steps = [f"train.steps={args.steps}", f"checkpoint.every={args.steps // 2}", "schedule.warmup_steps=2"]
        subprocess.run(train_cmd(args.config, root, *steps), check=True, capture_output=True)
        rows = [json.loads(x) for x in (root / "bench" / "metrics.jsonl").read_text().splitlines()]
        saves = [r["checkpoint_save_s"] for r in rows if "checkpoint_save_s" in r]
        ckpt = root / "bench" / "checkpoints" / f"step_{args.steps:08d}"
        size = sum(p.stat().st_size for p in ckpt.iterdir())
        n_files = len(list(ckpt.iterdir()))

        more = [f"train.steps={args.steps + 1}", f"checkpoint.every={args.steps // 2}", "schedule.warmup_steps=2"]
        out = subprocess.run(train_cmd(args.config, root, *more), check=True, capture_output=True, text=True)
        load_s = float(re.search(r"loaded in ([\d.]+) s", out.stdout + out.stderr).group(1))

        long_run = ["train.steps=100000", "checkpoint.every=0", "schedule.warmup_steps=2", "run.name=sigterm"]
        proc = subprocess.Popen(
            train_cmd(args.config, root, *long_run), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        metrics = root / "sigterm" / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
            time.sleep(0.05)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait()
        sigterm_s = time.perf_counter() - t0

    print(f"config {args.config}")
    print("| what | figure |\n| --- | --- |")
    print(f"| checkpoint size | {size / 2**20:.1f} MiB ({n_files} files) |")
    print(f"| save time | {', '.join(f'{s:.2f}' for s in saves)} s |")
    print(f"| load time (auto-resume) | {load_s:.2f} s |")
    print(f"| SIGTERM to exit (checkpoint included), exit code {code} | {sigterm_s:.2f} s |")


if __name__ == "__main__":
    main()
