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

from helpers.runs import ENV, REPO

from megabam.data.corpus import python_stdlib_documents
from megabam.data.shards import iter_mds_samples
from megabam.data.tokenizer import train_tokenizer

FILES, FILE_DOCS = 24, 120


def samples(out):
    return {
        split: [(s["tokens"].tolist(), s["doc_starts"].tolist()) for s in iter_mds_samples(out / split)]
        for split in ("train", "val")
    }


def test_a_killed_prepare_resumes_to_the_dataset_an_uninterrupted_one_writes(tmp_path):
    tok = tmp_path / "tok.model"
    train_tokenizer(python_stdlib_documents(200_000), tok, vocab_size=512)
    docs = python_stdlib_documents(4_000_000)
    rng = random.Random(0)
    (tmp_path / "in").mkdir()
    for i in range(FILES):
        chosen = [rng.choice(docs)[:4000] for _ in range(FILE_DOCS)]
        (tmp_path / "in" / f"{i:02d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in chosen))

    def command(out):
        cmd = [sys.executable, "-m", "megabam.cli", "data", "prepare", str(tmp_path / "in"), "--out", str(out)]
        return cmd + ["--tokenizer", str(tok), "--seq-len", "127", "--workers", "2", "--task-size", "100kb"]

    whole = subprocess.run(command(tmp_path / "whole"), capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]
    tasks = json.loads((tmp_path / "whole" / "meta.json").read_text())["tasks"]
    assert tasks >= 12

    staging = tmp_path / ".cut.prepare"
    proc = subprocess.Popen(command(tmp_path / "cut"), env=ENV, cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while len(list((staging / "done").glob("*.json"))) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "the prepare ended before it could be cut"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kept = len(list((staging / "done").glob("*.json")))
    assert not (tmp_path / "cut").exists() and 3 <= kept < tasks

    again = subprocess.run(command(tmp_path / "cut"), capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"prepare: resuming: {kept} of {tasks} tasks already done" in again.stderr
    assert samples(tmp_path / "cut") == samples(tmp_path / "whole")
    counts = [json.loads((tmp_path / run / "meta.json").read_text())["summary"] for run in ("cut", "whole")]
    for key in ("documents", "tokens", "tokens_dropped", "samples", "input_bytes"):
        assert counts[0][key] == counts[1][key], key
    assert not staging.exists() and not [p for p in (tmp_path / "cut").rglob(".*")]
