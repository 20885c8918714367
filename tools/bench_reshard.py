"""Time and peak host memory of `megabam convert reshard` against checkpoint size.

For each model width, yaml_configs/tiny_cpu.yaml's architecture at that width (--layers) trains one
step at TP=2 (ZeRO-1, fp32, two gloo processes) and checkpoints; the checkpoint (weights, fp32 master
weights, Adam moments) is resharded to TP=1 × PP=2 in a fresh process. Reported: wall time, the
parent's peak (VmHWM) and the largest rank's peak (getrusage of the waited-for children); the peer,
measured in the same run, is a training rank of the same new layout: the resharded run resumed for
one more step, its largest rank's peak. Usage:

    .venv/bin/python tools/bench_reshard.py [--widths 256 512 1024] [--layers 8] [--dir /tmp/bench_reshard]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMALL = [
    "data.seq_len=64",
    "data.passkey_min_tokens=null",
    "data.passkey_fraction=0",
    "train.micro_batch_size=1",
    "train.eval_batches=1",
    "eval.passkey_samples=0",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
    "schedule.warmup_steps=0",
]

# Runs one command and reports its wall time, its own peak and its largest waited-for child's peak.
CHILD = r"""
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
if sys.argv[1] == "reshard":
    from megabam.cli import main
    code = main(["convert", "reshard", *sys.argv[2:]])
else:
    code = subprocess.run(sys.argv[2:]).returncode
own = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) / 1024
child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps({"code": code, "wall_s": time.perf_counter() - t0, "own_mib": own, "child_mib": child}))
"""


def measured(args: list[str], env: dict) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env, cwd=REPO)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines or json.loads(lines[-1])["code"]:
        sys.exit(f"failed: {args}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])


def train(config: Path, overrides: list[str], nproc: int) -> list[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return ["run", *launch, "-m", "megabam.cli", "train", str(config), *overrides]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dir", type=Path, default=Path("/tmp/bench_reshard"))
    a = p.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    rows = []
    for width in a.widths:
        name = f"d{width}"
        shape = [f"model.d_model={width}", f"model.n_layers={a.layers}", "train.steps=1", "checkpoint.every=1"]
        where = [f"run.output_dir={a.dir}", f"run.name={name}", "parallel.tensor=2", *SMALL, *shape]
        measured(train(REPO / "yaml_configs" / "tiny_cpu.yaml", where, 2), env)
        ckpt = a.dir / name / "checkpoints" / "step_00000001"
        size = sum(f.stat().st_size for f in ckpt.iterdir() if f.suffix == ".pt") / 2**20
        out = a.dir / f"{name}-tp1pp2"
        reshard = measured(["reshard", str(ckpt), str(out), "--tp", "1", "--pp", "2"], env)
        resume = [f"run.output_dir={a.dir}", f"run.name={out.name}", "train.steps=2"]
        peer = measured(train(out / "config.yaml", resume, 2), env)
        rows.append((width, size, reshard, peer))
        print(f"d{width}: {size:.0f} MiB, reshard {reshard}, resumed rank {peer}", flush=True)
    print(
        "\n| d_model | checkpoint MiB | reshard wall s | parent peak MiB | largest rank peak MiB "
        "| training rank peak MiB (peer) | rank ratio |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for width, size, r, peer in rows:
        ratio = r["child_mib"] / peer["child_mib"]
        print(
            f"| {width} | {size:,.0f} | {r['wall_s']:.1f} | {r['own_mib']:,.0f} | {r['child_mib']:,.0f} "
            f"| {peer['child_mib']:,.0f} | {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
