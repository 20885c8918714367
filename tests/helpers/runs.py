"""Running `megabam train` as a user would (a subprocess), for the training and resume tests."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "yaml_configs" / "tiny_cpu.yaml"
# Small enough to run in seconds, large enough that the loss must fall. No wandb: its start costs
# ~2 s per run (tests/e2e/test_train.py's main job and SIGTERM resume keep it, offline). The recipe
# keys the main job tunes for passkey retrieval (docs/results.md) are pinned to the values the
# parallel-vs-single-process tolerances were measured with: the tests check the machinery, the
# main job's recipe is checked by running it.
SMALL = [
    "model.init_std=0.02",
    "model.attention.ssmax_init=1.0",
    "model.attention.bam.init=mixed",
    "optim.prior_lr_mult=10.0",
    "data.passkey_fraction=0.25",
    "data.passkey_min_tokens=null",
    "model.d_model=64",
    "model.n_layers=2",
    "data.seq_len=128",
    "data.corpus_bytes=1000000",
    "train.micro_batch_size=4",
    "schedule.warmup_steps=3",
    "train.eval_batches=2",
    "logging.log_every=1",
    "logging.progress_bar=false",
    "eval.passkey_samples=2",
    "eval.passkey_lengths=[]",
    "logging.wandb_mode=disabled",
    "logging.plots=false",  # matplotlib's ~0.4 s per run; the main job's test draws them
]


def train_command(
    run_root: Path, cache: Path, *overrides, resume=False, nproc=1, config=CONFIG, nan_steps=()
) -> list[str]:
    """`megabam train` as a user runs it (the repo's launch script for several processes); with
    `nan_steps`, through tests/helpers/inject_nan.py, which makes those steps' loss NaN."""
    args = [f"run.output_dir={run_root}", f"data.cache_dir={cache}", *SMALL, *overrides]
    if nan_steps:
        script = [str(Path(__file__).with_name("inject_nan.py")), ",".join(map(str, nan_steps)), "train"]
        launch = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd = [sys.executable, *launch, *script, str(config), *args]
    elif nproc == 1:
        cmd = [sys.executable, "-m", "megabam.cli", "train", str(config), *args]
    else:  # through the repo's own launch script, as a user would
        cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), str(nproc), str(config), *args]
    return cmd + ["--resume"] if resume else cmd


ENV = dict(os.environ, OMP_NUM_THREADS="1", MEGABAM_PYTHON=sys.executable)


def megabam_train(
    run_root: Path, cache: Path, *overrides, resume=False, nproc=1, check=True, config=CONFIG, nan_steps=(), env=None
):
    cmd = train_command(run_root, cache, *overrides, resume=resume, nproc=nproc, config=config, nan_steps=nan_steps)
    result = subprocess.run(cmd, capture_output=True, text=True, env={**ENV, **(env or {})}, timeout=600, cwd=REPO)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def logged(run_dir: Path, key: str) -> dict[int, float]:
    """Step → logged value of `key`; a step logged twice (redone after a resume) keeps its last value."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def losses(run_dir: Path) -> dict[int, float]:
    return logged(run_dir, "loss")


def start_train(run_root: Path, cache: Path, *overrides, nproc=1, log: Path) -> subprocess.Popen:
    """`megabam train` in the background, in its own process group (so a test can kill all of it)."""
    cmd = train_command(run_root, cache, *overrides, nproc=nproc)
    out = log.open("a")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=REPO, start_new_session=True)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Block until metrics.jsonl records a loss at `step` or later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"training exited with {proc.returncode} before step {step}")
        path = run_dir / "metrics.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) >= step and "loss" in json.loads(line):
                        return
                except ValueError:
                    pass
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def is_rank(cmdline: str) -> bool:
    """Whether a process's command line is a `megabam train` rank (not its launcher or torchrun)."""
    return (
        "megabam.cli train" in cmdline
        and "torch.distributed.run" not in cmdline
        and "megabam.parallel.torchrun" not in cmdline
    )


def ranks_of(run_root: Path) -> list[psutil.Process]:
    """Live `megabam train` ranks of the runs under `run_root`."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if is_rank(cmdline) and f"run.output_dir={run_root}" in cmdline:
            found.append(p)
    return found
