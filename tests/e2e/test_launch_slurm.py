"""launch/slurm.sbatch on a real single-node Slurm (slurmctld, slurmd and munge started by the test):
`megabam launch slurm --wait` submits 2 ranks (one task per rank) that train like one process, with a
shell-hostile run name reaching the trainer whole; a second job (one torchrun per node) gets
SIGUSR1 from the scheduler mid-run, saves, exits 75, is requeued and finishes from its checkpoint with
the uninterrupted job's losses, each restart logging to files of its own."""

import json
import subprocess
import sys
import time

import pytest
from helpers.runs import CONFIG, ENV, SMALL, losses, megabam_train
from helpers.slurm_cluster import SlurmCluster, missing

REASON = missing()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no test Slurm: {REASON}")
RUN = ["train.steps=16", "checkpoint.every=0", "train.eval_every=0", "train.micro_batch_size=2"]
LOSS_RTOL = 1e-6
HOSTILE = "x; touch pwned"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()


def submit(cluster, root, data_cache, name, *options, background=False):
    """`megabam launch slurm ... --wait`: done when the job is (in the background: a Popen)."""
    cmd = [sys.executable, "-m", "megabam.cli", "launch", "slurm", str(CONFIG), f"run.output_dir={root}"]
    cmd += [f"data.cache_dir={data_cache}", *SMALL, *RUN, f"run.name={name}", "--gpus-per-node", "2", "--cpu"]
    cmd += ["--log-root", str(root / "logs"), "--wait", *options]
    env = dict(ENV, SLURM_CONF=cluster.env["SLURM_CONF"])
    if background:
        return subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("jobs")
    result = submit(cluster, root, data_cache, HOSTILE, "--job-name", "whole", "--mode", "task")
    assert result.returncode == 0, result.stderr[-3000:] + cluster.logs()
    return root, losses(root / HOSTILE)


def test_two_tasks_train_like_one_process_with_the_arguments_whole(uninterrupted, tmp_path, data_cache):
    root, two = uninterrupted
    megabam_train(tmp_path, data_cache, "run.name=one", *RUN[:3], "train.micro_batch_size=4")
    one = losses(tmp_path / "one")
    assert sorted(two) == list(range(1, 17))
    for step, loss in one.items():
        assert two[step] == pytest.approx(loss, rel=LOSS_RTOL), step
    assert not (root / "pwned").exists()
    (job_logs,) = [p for p in (root / "logs").glob("whole-*") if p.is_dir()]
    assert sorted(p.name for p in job_logs.iterdir()) == ["rank0.restart0.log", "rank1.restart0.log"]


def test_a_signalled_job_checkpoints_requeues_and_finishes_with_the_same_losses(
    cluster, uninterrupted, tmp_path, data_cache
):
    _, whole = uninterrupted
    job = submit(cluster, tmp_path, data_cache, "pre", "--job-name", "pre", "--mode", "node", background=True)
    metrics = tmp_path / "pre" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and any(json.loads(x).get("step") == 2 for x in metrics.read_text().splitlines())):
        assert job.poll() is None and time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    (job_id,) = [
        line.split()[0]
        for line in subprocess.run(
            ["squeue", "-h", "-n", "pre", "-o", "%i"], capture_output=True, text=True, env=cluster.env
        ).stdout.splitlines()
    ]
    # What --signal=B:USR1@N does before the time limit, sent now: SIGUSR1 to the batch script.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, env=cluster.env)
    out, _ = job.communicate(timeout=600)
    assert job.returncode == 0, out + cluster.logs()

    (job_logs,) = [p for p in tmp_path.glob("logs/pre-*") if p.is_dir()]
    first, second = (job_logs / "node0.restart0.log").read_text(), (job_logs / "node0.restart1.log").read_text()
    assert "preempted after step" in first and "resumed from" in second
    batch = (tmp_path / "logs" / f"pre-{job_id}.batch.log").read_text()
    assert "exited 75: requeueing job" in batch and "(restart 1)" in batch
    resumed = losses(tmp_path / "pre")
    assert sorted(resumed) == list(range(1, 17))
    for step, loss in whole.items():
        assert resumed[step] == pytest.approx(loss, rel=LOSS_RTOL), step
