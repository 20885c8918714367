"""Starts and restarts that must neither hang nor lose a checkpoint: an oversized micro-batch, two runs
on one directory, a lowered step count on resume, a kill before the first checkpoint, and a signal
during start-up. Each fault is the one a user or a scheduler really produces."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.runs import logged, megabam_train, ranks_of, start_train, wait_for_step

from megabam.cli import main
from megabam.data.corpus import python_stdlib_documents
from megabam.data.shm_cleanup import MIN_AGE_S
from megabam.data.tokenizer import train_tokenizer
from megabam.parallel.distributed import default_extensions_dir


def digests(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha1(p.read_bytes()).hexdigest() for p in path.rglob("*") if p.is_file()}


def test_micro_batch_larger_than_the_data_is_refused_at_start(tmp_path, data_cache):
    t0 = time.monotonic()
    result = megabam_train(tmp_path, data_cache, "run.name=huge", "train.micro_batch_size=100000", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("megabam: error: <data>: train.micro_batch_size: 100000 is more than the ")
    assert last.endswith("training samples each data-parallel rank reads per epoch")
    assert time.monotonic() - t0 < 120 and not (tmp_path / "huge").exists()


def test_a_validation_split_smaller_than_a_micro_batch_is_refused_or_turned_off(tmp_path, data_cache, capsys):
    """`data prepare`'s default --val-fraction on a small corpus gave fewer validation samples than one
    micro-batch, and training logged a val loss of NaN at every evaluation without a word. Now prepare
    warns, training refuses at start with both numbers, and train.eval_batches=0 trains without
    validation and says so."""
    tok = tmp_path / "tok.model"
    train_tokenizer(python_stdlib_documents(200_000), tok, vocab_size=400)
    (tmp_path / "in.txt").write_text("\n".join(f"line {i} of some text" for i in range(3000)))
    prepare = ["data", "prepare", str(tmp_path / "in.txt"), "--out", str(tmp_path / "ds"), "--tokenizer", str(tok)]
    prepare += ["--seq-len", "64", "--text-unit", "line", "--val-fraction", "0.005", "--workers", "0", "--no-progress"]
    assert main(prepare) == 0
    val = json.loads((tmp_path / "ds" / "meta.json").read_text())["summary"]["samples"]["val"]
    assert 0 < val < 8 and f"warning: the validation split has {val} samples, under 64" in capsys.readouterr().out
    mds = ["data.source=mds", f"data.tokenizer={tok}", f"data.streams=[{{path: {tmp_path / 'ds'}}}]"]
    mds += ["model.vocab_size=400", "data.seq_len=64", "train.micro_batch_size=8", "eval.passkey_samples=0"]
    refused = megabam_train(tmp_path, data_cache, "run.name=small", *mds, check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines()[-1] == (
        f"megabam: error: <data>: train.eval_batches: the validation data holds {val} samples per data-parallel "
        "rank, fewer than one micro-batch of 8 (train.micro_batch_size): prepare more validation data (data "
        "prepare --val-fraction) or set train.eval_batches=0 to train without validation"
    )
    assert not (tmp_path / "small").exists() and not (tmp_path / ".small.lock").exists()  # nothing left behind
    off = megabam_train(tmp_path, data_cache, "run.name=small", *mds, "train.eval_batches=0", "train.steps=3")
    assert "val loss        off (train.eval_batches=0)" in off.stdout and "nan" not in off.stdout
    assert sorted(logged(tmp_path / "small", "loss")) == [1, 2, 3] and not logged(tmp_path / "small", "val_loss")


def test_a_second_run_on_the_same_directory_is_refused_naming_the_first(tmp_path, data_cache):
    first = start_train(
        tmp_path, data_cache, "run.name=shared", "train.steps=100000", "checkpoint.every=0", log=tmp_path / "first.log"
    )
    try:
        wait_for_step(tmp_path / "shared", 1, first)
        second = megabam_train(tmp_path, data_cache, "run.name=shared", "train.steps=12", check=False)
        assert second.returncode == 2
        last = second.stderr.strip().splitlines()[-1]
        assert f"{tmp_path / 'shared'}: in use by another run (host " in last and f", pid {first.pid})" in last
        assert (tmp_path / ".shared.lock").exists()  # the refused start let the first run's lock be
        first.send_signal(signal.SIGTERM)  # the first run is untouched: it still saves and stops cleanly
        assert first.wait(timeout=300) == 75
        assert not (tmp_path / ".shared.lock").exists()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    # The first run's record is its own: every step logged once, in order, up to its checkpoint.
    steps = [json.loads(line)["step"] for line in (tmp_path / "shared" / "metrics.jsonl").read_text().splitlines()]
    loss_steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "shared" / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert loss_steps == list(range(1, len(loss_steps) + 1)) and max(steps) == loss_steps[-1]
    assert (tmp_path / "shared" / "checkpoints" / "latest").read_text().strip() == f"step_{loss_steps[-1]:08d}"


def test_lowering_train_steps_on_resume_keeps_every_checkpoint(tmp_path, data_cache):
    megabam_train(tmp_path, data_cache, "run.name=done", "train.steps=6", "checkpoint.every=3")
    checkpoints = tmp_path / "done" / "checkpoints"
    before = digests(checkpoints)
    result = megabam_train(tmp_path, data_cache, "run.name=done", "train.steps=4", check=False)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.endswith("is at step 6, beyond train.steps=4; nothing to do (raise train.steps to train on)")
    assert digests(checkpoints) == before
    # Neither the run nor the refused start left its lock; DeepSpeed's recovery scripts (which unpickle
    # with weights_only=False) are not kept beside the checkpoints.
    assert not (tmp_path / ".done.lock").exists() and not list(checkpoints.glob("zero_to_*.py"))
    # The same step count again is a finished run: its stored summary, and nothing trained or written.
    run, stored = tmp_path / "done", json.loads((tmp_path / "done" / "summary.json").read_text())
    files = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    everything = digests(run)
    again = megabam_train(tmp_path, data_cache, "run.name=done", "train.steps=6")
    assert f"megabam: {run} is already complete at step 6 (train.steps); nothing to do" in again.stdout
    assert f"val loss        {stored['val_loss']:.4f}" in again.stdout and "resumed from" not in again.stderr
    assert digests(run) == everything and {p: p.stat().st_mtime_ns for p in run.rglob("*")} == files


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (the kernel's SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_sigterm_during_start_up_exits_75(tmp_path, data_cache):
    proc = start_train(tmp_path, data_cache, "run.name=startup", log=tmp_path / "startup.log")
    # Sent once the start-up handler is in place (a fixed sleep raced it on a loaded machine: the
    # default action killed the process), still long before the first step: torch and DeepSpeed
    # take seconds to import after it.
    deadline = time.monotonic() + 60
    while not catches(proc.pid, signal.SIGTERM) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None and catches(proc.pid, signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 75
    assert "SIGTERM during start-up; nothing to save, exit 75 (requeue)" in (tmp_path / "startup.log").read_text()


def test_the_launcher_exits_with_the_ranks_code(tmp_path, data_cache):
    """launch/torchrun.sh: 75 when SIGTERM to the script preempts both ranks, 2 for bad input (torchrun says 1)."""
    proc = start_train(
        tmp_path,
        data_cache,
        "run.name=launcher",
        "train.steps=100000",
        "checkpoint.every=0",
        nproc=2,
        log=tmp_path / "launcher.log",
    )
    wait_for_step(tmp_path / "launcher", 2, proc)
    proc.send_signal(signal.SIGTERM)  # to the launch script, as a scheduler signals the job
    assert proc.wait(timeout=300) == 75
    # Rank 0 speaks once, naming its own signal or, when the other rank's arrived first, that one.
    assert (tmp_path / "launcher.log").read_text().count("preempted (") == 1
    assert (tmp_path / "launcher" / "checkpoints" / "latest").is_file()
    bad = megabam_train(tmp_path, data_cache, "run.name=bad", "parallel.tensor=3", nproc=2, check=False)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "parallel.tensor: 3 does not divide model.n_heads=4" in bad.stderr
    assert "ChildFailedError" not in bad.stderr and "Traceback" not in bad.stderr  # torchrun's report: not due


def test_killing_the_launchers_process_group_stops_every_rank(tmp_path, data_cache):
    proc = start_train(
        tmp_path,
        data_cache,
        "run.name=orphans",
        "train.steps=100000",
        "checkpoint.every=0",
        nproc=2,
        log=tmp_path / "orphans.log",
    )
    wait_for_step(tmp_path / "orphans", 2, proc)
    assert len(ranks_of(tmp_path)) == 2
    os.killpg(proc.pid, signal.SIGKILL)  # what a scheduler kills: the launcher's group, not the ranks' sessions
    proc.wait()
    deadline = time.monotonic() + 30
    while ranks_of(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ranks_of(tmp_path), "ranks outlived their launcher"


def test_a_build_lock_left_by_a_killed_build_is_cleared_with_a_message(tmp_path, data_cache):
    """torch's builder waits for ever on the `lock` file of a build killed midway; megabam, holding its
    own lock on the folder, knows such a file is stale. A folder of its own (seeded with the built op
    when there is one): in the shared one, the other test worker's training would remove the file."""
    shared, folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or default_extensions_dir()), tmp_path / "ext"
    if shared.is_dir():
        shutil.copytree(shared, folder, ignore=shutil.ignore_patterns("lock", ".megabam-build.lock"))
    stale = folder / "deepspeed_shm_comm" / "lock"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("")
    result = megabam_train(
        tmp_path,
        data_cache,
        "run.name=stale",
        "train.steps=3",
        "eval.passkey_samples=0",
        env={"TORCH_EXTENSIONS_DIR": str(folder)},
    )
    assert f"removed a stale build lock {stale}" in result.stdout and not stale.exists()


def test_default_data_that_cannot_be_built_is_a_one_line_error(tmp_path, data_cache):
    """A vocabulary sentencepiece cannot train on the default corpus, and sequences too short for its
    passkey documents: one line naming the key, exit 2, nothing left behind."""
    cache = tmp_path / "cache"
    for override, message in [
        ("model.vocab_size=100", "model.vocab_size: the default corpus cannot train a tokenizer of 100 pieces"),
        ("data.seq_len=1", "data.seq_len: 1 tokens cannot hold the default data's passkey documents"),
    ]:
        result = megabam_train(tmp_path, cache, "run.name=nodata", override, check=False)
        assert result.returncode == 2, result.stderr[-2000:]
        assert message in result.stderr.strip().splitlines()[-1]
        assert not (tmp_path / "nodata").exists() and not [p for p in cache.glob("*") if p.is_dir()]


def _fill(path: Path) -> None:
    """Write into `path` until the filesystem is full (smaller and smaller writes take the last bytes)."""
    with path.open("wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass


def test_a_full_disk_during_a_save_says_the_previous_checkpoint_is_intact(tmp_path, data_cache):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("needs a small filesystem to fill: `mount -t tmpfs` is not allowed here (not root?)")
    proc = None
    try:
        run = ["run.name=full", "checkpoint.every=3", "checkpoint.keep=5", "logging.wandb_mode=disabled"]
        proc = start_train(disk, data_cache, *run, "train.steps=100000", log=tmp_path / "full.log")
        wait_for_step(disk / "full", 4, proc)  # the step-3 checkpoint is complete
        # The job is paused while the disk fills, so no save completes in between (one did, under load).
        os.killpg(proc.pid, signal.SIGSTOP)
        checkpoints = disk / "full" / "checkpoints"
        before = {p.name: digests(p) for p in checkpoints.glob("step_*")}
        _fill(disk / "filler")
        os.killpg(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=300) == 2
        saved = checkpoints / max(before)
        last = (tmp_path / "full.log").read_text().strip().splitlines()[-1]
        assert last.startswith(f"megabam: error: {checkpoints}/step_")
        assert last.endswith(f": saving failed (No space left on device); the previous checkpoint {saved} is intact")
        assert {p.name: digests(p) for p in checkpoints.glob("step_*")} == before
        assert not list(checkpoints.glob(".tmp-*"))
        (disk / "filler").unlink()
        step = int(saved.name.removeprefix("step_"))
        resumed = megabam_train(disk, data_cache, *run, f"train.steps={step + 2}")
        assert f"resumed from {saved} at step {step}" in resumed.stdout
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        subprocess.run(["umount", "-l", str(disk)])


def test_a_job_killed_before_its_first_checkpoint_restarts_from_step_zero_and_frees_its_shared_memory(
    tmp_path, data_cache
):
    """kill -9 of a whole training job before its first checkpoint leaves what it wrote but no checkpoint,
    and streaming's /dev/shm segments (nothing frees them); the next start says it begins again from
    step 0 and removes the segments no live process maps."""
    proc = start_train(
        tmp_path, data_cache, "run.name=early", "train.steps=1000", "checkpoint.every=0", log=tmp_path / "killed.log"
    )
    try:
        wait_for_step(tmp_path / "early", 2, proc)
        (rank,) = ranks_of(tmp_path)
        segments = {line.split()[-1] for line in Path(f"/proc/{rank.pid}/maps").read_text().splitlines()}
        segments = {s for s in segments if s.startswith("/dev/shm/") and s[9:15].isdigit()}
        assert segments
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole job, as a scheduler kills it
        proc.wait()
    assert not list((tmp_path / "early").glob("checkpoints/step_*"))
    # Left behind (a later job may take the same name: the files are told apart by inode).
    left = {(s, os.stat(s).st_ino) for s in segments}
    time.sleep(MIN_AGE_S)  # the cleanup spares segments younger than this (a job may be creating them)
    result = megabam_train(tmp_path, data_cache, "run.name=early", "train.steps=3", "eval.passkey_samples=0")
    assert "no checkpoint yet, only what an earlier start wrote; starting again from step 0" in result.stdout
    assert (tmp_path / "early" / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert not [s for s, inode in left if Path(s).exists() and os.stat(s).st_ino == inode]


def test_a_read_only_output_directory_is_one_line(tmp_path, data_cache):
    disk = tmp_path / "ro"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("needs a read-only filesystem: `mount -t tmpfs` is not allowed here (not root?)")
    try:
        result = megabam_train(disk, data_cache, "run.name=ro", "train.steps=3", check=False)
    finally:
        subprocess.run(["umount", "-l", str(disk)])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"megabam: error: {disk}: cannot write the run's lock there (Read-only file system)"
    )
    assert "Traceback" not in result.stderr
