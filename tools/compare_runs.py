"""Compare two run directories' metrics.jsonl step by step (torchtitan's loss-curve check).

    python tools/compare_runs.py RUN_A RUN_B [--keys loss val_loss ...] [--rtol 0]

For every metric both runs logged (timings excluded: they differ run to run), prints how many steps
were compared, how many values are bit-identical and the largest relative difference. Exit 0 when
every compared value agrees within --rtol (default 0: bit-identical), 1 when one does not, 2 when a
run directory or its metrics file is missing or unreadable.
"""

import argparse
import json
import math
import sys
from pathlib import Path

# Wall-clock figures, different in every run even when the computation is identical.
TIMINGS = {"tokens_per_s", "tflops_per_device", "mfu", "checkpoint_save_s"}


def read_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """metric → step → value; a step logged twice (redone after a resume) keeps its last value."""
    path = run_dir / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"compare_runs: {path}: cannot read ({e.strerror})") from None
    metrics: dict[str, dict[int, float]] = {}
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            step = row.pop("step")
        except (ValueError, KeyError, AttributeError):
            raise SystemExit(f"compare_runs: {path}:{number}: not a metrics row") from None
        heads = row.pop("heads", {})  # per-head prior and SSMax values, compared like the rest
        for key, value in {**row, **heads}.items():
            metrics.setdefault(key, {})[step] = math.nan if value is None else value
    return metrics


def relative_difference(a: float, b: float) -> float:
    if a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def compare(a: dict, b: dict, keys: list[str] | None) -> list[tuple[str, int, int, float]]:
    """(metric, steps compared, steps bit-identical, largest relative difference) per shared metric."""
    shared = sorted((set(a) & set(b)) - TIMINGS) if keys is None else keys
    rows = []
    for key in shared:
        steps = sorted(set(a.get(key, {})) & set(b.get(key, {})))
        diffs = [relative_difference(a[key][s], b[key][s]) for s in steps]
        rows.append((key, len(steps), sum(d == 0.0 for d in diffs), max(diffs, default=0.0)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--keys", nargs="+", help="metrics to compare (default: every metric both logged)")
    parser.add_argument("--rtol", type=float, default=0.0, help="largest relative difference accepted (default 0)")
    args = parser.parse_args(argv)
    try:
        rows = compare(read_metrics(args.run_a), read_metrics(args.run_b), args.keys)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    print(f"{'metric':<24} {'steps':>6} {'identical':>10} {'max rel diff':>13}")
    ok = True
    for key, steps, identical, worst in rows:
        print(f"{key:<24} {steps:>6} {identical:>10} {worst:>13.3g}")
        ok &= steps > 0 and worst <= args.rtol
    print("agree" if ok else "DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
