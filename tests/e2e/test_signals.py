"""Signals to the real PIDs of a training job, as a user or a scheduler sends them: Ctrl-C (SIGINT)
saves a checkpoint and exits 130, alone and through launch/torchrun.sh; `megabam launch local` passes
SIGTERM on to its ranks and exits with their 75; kill -9 of launch/torchrun.sh leaves no rank running."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

from helpers.runs import CONFIG, ENV, REPO, SMALL, ranks_of, start_train, wait_for_step

LONG = ["train.steps=100000", "checkpoint.every=0"]


def interrupted_at(log_text: str, code: int) -> int:
    """The step at which every rank said 'checkpoint saved, exit CODE' (one line per rank)."""
    pattern = rf"megabam: (?:interrupted|preempted) after step (\d+); checkpoint saved, exit {code}"
    (step,) = set(re.findall(pattern, log_text))
    return int(step)


def wait_for_no_ranks(root, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while ranks_of(root) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ranks_of(root), "ranks outlived their launcher"


def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path, data_cache):
    log = tmp_path / "ctrlc.log"
    proc = start_train(tmp_path, data_cache, "run.name=ctrlc", *LONG, log=log)
    wait_for_step(tmp_path / "ctrlc", 2, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    text = log.read_text()
    step = interrupted_at(text, 130)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert (tmp_path / "ctrlc" / "checkpoints" / "latest").read_text().strip() == f"step_{step:08d}"


def test_sigint_to_the_torchrun_script_saves_on_every_rank_and_exits_130(tmp_path, data_cache):
    log = tmp_path / "int.log"
    proc = start_train(tmp_path, data_cache, "run.name=int", *LONG, nproc=2, log=log)
    wait_for_step(tmp_path / "int", 2, proc)
    os.kill(proc.pid, signal.SIGINT)  # the script's own PID, not its process group
    assert proc.wait(timeout=120) == 130
    step = interrupted_at(log.read_text(), 130)
    assert (tmp_path / "int" / "checkpoints" / "latest").read_text().strip() == f"step_{step:08d}"
    wait_for_no_ranks(tmp_path, 5)


def test_megabam_launch_local_passes_sigterm_to_its_ranks_and_exits_75(tmp_path, data_cache):
    cmd = [sys.executable, "-m", "megabam.cli", "launch", "local", str(CONFIG), f"run.output_dir={tmp_path}"]
    cmd += [f"data.cache_dir={data_cache}", *SMALL, "run.name=local", *LONG, "--gpus-per-node", "2"]
    log = tmp_path / "local.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=REPO, start_new_session=True)
    try:
        wait_for_step(tmp_path / "local", 2, proc)
        os.kill(proc.pid, signal.SIGTERM)  # the launcher's PID alone, as a scheduler or `kill` would
        assert proc.wait(timeout=120) == 75
        step = interrupted_at(log.read_text(), 75)
        assert (tmp_path / "local" / "checkpoints" / "latest").read_text().strip() == f"step_{step:08d}"
        wait_for_no_ranks(tmp_path, 5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_kill_9_of_the_torchrun_script_leaves_no_rank_running(tmp_path, data_cache):
    proc = start_train(tmp_path, data_cache, "run.name=nine", *LONG, nproc=2, log=tmp_path / "nine.log")
    try:
        wait_for_step(tmp_path / "nine", 2, proc)
        assert len(ranks_of(tmp_path)) == 2
        os.kill(proc.pid, signal.SIGKILL)  # the script alone: torchrun and the ranks must follow it
        proc.wait()
        wait_for_no_ranks(tmp_path)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
