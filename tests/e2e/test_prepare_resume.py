"""`megabam data prepare` killed mid-way (SIGKILL to its whole process group: the command and its
workers, as a scheduler kills a job) and started again with the same arguments: the finished tasks are
kept (their shards verified), the rest redone, and the dataset equals an uninterrupted run's."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers.prepared import prepared_samples
from helpers.runs import ENV, REPO

from megabam.data.corpus import python_stdlib_documents
from megabam.data.tokenizer import train_tokenizer

FILES, FILE_DOCS = 24, 40  # ~3.8 MB: ~38 tasks of 100 KB


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(input folder, tokenizer): FILES JSON Lines files of stdlib sources, tasks of ~100 KB."""
    root = tmp_path_factory.mktemp("prepare_kill")
    tok = root / "tok.model"
    train_tokenizer(python_stdlib_documents(200_000), tok, vocab_size=512)
    docs = python_stdlib_documents(4_000_000)
    rng = random.Random(0)
    (root / "in").mkdir()
    for i in range(FILES):
        chosen = [rng.choice(docs)[:4000] for _ in range(FILE_DOCS)]
        (root / "in" / f"{i:02d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in chosen))
    return root / "in", tok


def command(corpus, out):
    cmd = [sys.executable, "-m", "megabam.cli", "data", "prepare", str(corpus[0]), "--out", str(out)]
    return cmd + ["--tokenizer", str(corpus[1]), "--seq-len", "127", "--workers", "2", "--task-size", "100kb"]


def wait_for_done(staging, n, proc):
    deadline = time.monotonic() + 300
    while len(list((staging / "done").glob("*.json"))) < n:
        assert proc.poll() is None and time.monotonic() < deadline, "the prepare ended before it could be cut"
        time.sleep(0.01)


def test_a_killed_prepare_resumes_to_the_dataset_an_uninterrupted_one_writes(tmp_path, corpus):
    whole = subprocess.run(command(corpus, tmp_path / "whole"), capture_output=True, text=True, env=ENV, cwd=REPO)
    assert whole.returncode == 0, whole.stderr[-2000:]
    tasks = json.loads((tmp_path / "whole" / "meta.json").read_text())["tasks"]
    assert tasks >= 12

    staging = tmp_path / ".cut.prepare"
    proc = subprocess.Popen(command(corpus, tmp_path / "cut"), env=ENV, cwd=REPO, start_new_session=True)
    try:
        wait_for_done(staging, 3, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kept = len(list((staging / "done").glob("*.json")))
    assert not (tmp_path / "cut").exists() and 3 <= kept < tasks

    again = subprocess.run(command(corpus, tmp_path / "cut"), capture_output=True, text=True, env=ENV, cwd=REPO)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"prepare: resuming: {kept} of {tasks} tasks already done" in again.stderr
    assert prepared_samples(tmp_path / "cut") == prepared_samples(tmp_path / "whole")
    counts = [json.loads((tmp_path / run / "meta.json").read_text())["summary"] for run in ("cut", "whole")]
    for key in ("documents", "tokens", "tokens_dropped", "samples", "input_bytes"):
        assert counts[0][key] == counts[1][key], key
    assert not staging.exists() and not [p for p in (tmp_path / "cut").rglob(".*")]


def test_a_worker_killed_outright_ends_the_prepare_with_a_line_and_a_rerun_finishes(tmp_path, corpus):
    """The OOM killer's way: SIGKILL to one worker process alone. The command does not wait for the
    lost task for ever: it stops with one line, keeps the finished tasks, and the same command again
    finishes the dataset."""
    staging = tmp_path / ".cut.prepare"
    proc = subprocess.Popen(
        command(corpus, tmp_path / "cut"), env=ENV, cwd=REPO, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        wait_for_done(staging, 1, proc)
        # the spawned workers (not multiprocessing's resource tracker, also a child)
        workers = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert workers, "no worker process"
        os.kill(workers[0].pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1] == (
        "megabam: error: a prepare worker process died (killed, or out of memory?); the finished tasks are kept: "
        "run the same command again to do the rest"
    )
    assert (staging / "plan.json").is_file() and list((staging / "done").glob("*.json"))
    again = subprocess.run(command(corpus, tmp_path / "cut"), capture_output=True, text=True, env=ENV, cwd=REPO)
    assert again.returncode == 0 and "prepare: resuming: " in again.stderr, again.stderr[-2000:]
    assert sum(len(v) for v in prepared_samples(tmp_path / "cut").values()) > 0 and not staging.exists()
