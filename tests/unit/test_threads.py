"""Threads per process (megabam/parallel/threads.py): cores ÷ local ranks, OMP_NUM_THREADS winning,
the cgroup quota and CPU affinity read, bad values refused in one line; the real process obeys."""

import os
import shutil
import subprocess
import sys

import pytest

from megabam.errors import LaunchError
from megabam.parallel.threads import available_cores, thread_count


@pytest.mark.parametrize(
    "environ, cores, want",
    [
        ({}, 16, 16),
        ({"LOCAL_WORLD_SIZE": "2"}, 16, 8),
        ({"LOCAL_WORLD_SIZE": "3"}, 16, 5),
        ({"LOCAL_WORLD_SIZE": "2"}, 2, 1),
        ({"LOCAL_WORLD_SIZE": "4"}, 2, 1),  # never 0
        ({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "3"}, 16, 3),  # the user's setting wins
    ],
)
def test_thread_count(environ, cores, want):
    assert thread_count(environ, cores=cores)[0] == want


@pytest.mark.parametrize(
    "key, value", [("OMP_NUM_THREADS", "two"), ("OMP_NUM_THREADS", "0"), ("LOCAL_WORLD_SIZE", "-1")]
)
def test_bad_values_are_one_line_errors_naming_the_variable(key, value):
    with pytest.raises(LaunchError, match=f"environment: {key}: must be a positive integer, got '{value}'"):
        thread_count({key: value}, cores=4)


def test_cgroup_quota_caps_the_affinity(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")  # 1.5 cores' worth of time: 2 threads at most
    assert available_cores(cpu_max) == min(affinity, 2)
    cpu_max.write_text("50000 100000\n")
    assert available_cores(cpu_max) == 1
    cpu_max.write_text("max 100000\n")
    assert available_cores(cpu_max) == affinity
    assert available_cores(tmp_path / "missing") == affinity


PRINT_THREADS = "from megabam.parallel.threads import configure_cpu; print(configure_cpu())"


def _threads_of_a_process(env: dict, prefix=()) -> int:
    env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    out = subprocess.run([*prefix, sys.executable, "-c", PRINT_THREADS], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_a_process_takes_its_share_of_the_cores_it_may_run_on():
    cores = available_cores()
    assert _threads_of_a_process({"OMP_NUM_THREADS": None, "LOCAL_WORLD_SIZE": None}) == cores
    assert _threads_of_a_process({"OMP_NUM_THREADS": None, "LOCAL_WORLD_SIZE": "2"}) == max(1, cores // 2)
    assert _threads_of_a_process({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": None}) == 1
    if shutil.which("taskset"):  # the affinity a scheduler sets (Slurm's cpuset, taskset)
        assert _threads_of_a_process({"OMP_NUM_THREADS": None, "LOCAL_WORLD_SIZE": None}, ["taskset", "-c", "0"]) == 1


def test_launcher_question_answers_with_the_same_rule():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    ask = [sys.executable, "-m", "megabam.parallel.threads", "--local-ranks"]
    out = subprocess.run([*ask, "2"], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and int(out.stdout) == max(1, available_cores() // 2)
    bad = subprocess.run([*ask, "0"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "megabam: error: environment: LOCAL_WORLD_SIZE: must be a positive integer, got '0'"
    ]


FLUSH_CHECK = (
    "import torch; {before}from megabam.parallel.threads import configure_cpu, denormals_flushed; "
    "n = configure_cpu(); tiny = torch.full((n * 65536,), 1 << 22, dtype=torch.int32).view(torch.float32); "
    "print(n, int((tiny * 1.0).count_nonzero()), denormals_flushed(n))"
)


@pytest.mark.parametrize("pool_started_first", [False, True])
def test_denormals_are_flushed_on_every_thread_unless_the_pool_started_first(pool_started_first):
    """Each of two threads computes half of a product of denormals: flushed, every product is zero.
    Started before configure_cpu, torch's pool keeps an unflushed worker: half the products stay
    denormal, and configure_cpu says so."""
    before = "torch.full((1 << 17,), 1.0).mul(2.0); " if pool_started_first else ""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", FLUSH_CHECK.format(before=before)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    threads, unflushed, flushed = out.stdout.split()
    assert threads == "2"
    if pool_started_first:
        assert (int(unflushed), flushed) == (65536, "False")
        assert "denormal floats are not flushed on every torch thread" in out.stderr
    else:
        assert (int(unflushed), flushed) == (0, "True")
        assert "not flushed" not in out.stderr


def test_numpy_describing_float64_under_the_flag_does_not_warn():
    """With denormals flushed numpy finds float64's smallest subnormal to be 0 and warns, once per
    process (matplotlib's import, a plot, an eval): configure_cpu silences that warning alone."""
    code = (
        "import warnings; warnings.simplefilter('error'); "
        "from megabam.parallel.threads import configure_cpu; configure_cpu(); "
        "import numpy as np; print(np.finfo(np.float64).smallest_subnormal, np.finfo(np.float32).tiny)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "subnormal" not in out.stderr
