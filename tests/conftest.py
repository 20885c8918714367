"""Test-wide environment: CPU DeepSpeed, offline wandb, a per-session data cache, clean /dev/shm,
threads sized for the workers.

tests/unit: single process, fast (`pytest tests/unit` while developing); tests/e2e: several processes,
the CLI, kills and resumes; tests/helpers: what both share (not tests).

pytest runs two workers (pytest-xdist, `-n 2 --dist loadfile` in pyproject.toml; a file's tests stay
on one worker, so its module fixtures are built once). Most of the suite's time is processes starting
(imports), which one core runs, so two at a time on the CI machine's 2 cores nearly halve it. Each
worker, and every process a test starts that does not choose its own, gets cores ÷ workers torch
threads (megabam/parallel/threads.py's rule, workers for local ranks):
oversubscribed OpenMP threads ran 5× slower (docs/log/benchmarks-history.md, "CPU training speed").
"""

import glob
import os
import signal

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # before anything imports torch
    from megabam.parallel.threads import available_cores

    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, available_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    )

# A suite started in the background of a script (`cmd &`) inherits SIGINT ignored, and bash cannot
# trap a signal that was ignored when it started: launch/torchrun.sh would ignore the Ctrl-C that
# tests/e2e/test_signals.py sends. Every process a test starts gets SIGINT as a terminal's would.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402

from megabam.data.shm_cleanup import DEEPSPEED, clean_streaming, remove_stale  # noqa: E402


@pytest.fixture
def clean_shm():
    """Streaming keeps per-dataset state in /dev/shm; remove what a test leaves behind."""
    clean_streaming()
    yield
    clean_streaming()


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One default-dataset cache shared by every training test of the session."""
    return tmp_path_factory.mktemp("megabam_cache")


@pytest.fixture(autouse=True, scope="session")
def _remove_deepspeed_shm_buffers():
    """DeepSpeed's CPU all-reduce leaves a shared-memory buffer per rank and port; remove ours (those
    made during the session that no live process of the other worker still maps)."""
    before = set(glob.glob(DEEPSPEED))
    yield
    remove_stale(DEEPSPEED, only=set(glob.glob(DEEPSPEED)) - before)


# The longest files, longest first (per-file sums of a `--durations=0` run on 2026-12-02), so that no
# long file starts near the end while the other worker has nothing left: alphabetically test_resume.py
# and test_train.py (~30 % of the e2e time) came after most other files. With this order the two
# workers' busy time summed to 97 % of twice the wall time. Other files keep their order after these.
LONGEST_FIRST = [
    "e2e/test_resume.py",
    "e2e/test_train.py",
    "e2e/test_hf_export.py",
    "e2e/test_parallel_train.py",
    "e2e/test_reliability.py",
    "e2e/test_convert_parallel.py",
    "e2e/test_reshard.py",
    "e2e/test_tools.py",  # added 2026-12-04 (a 616 s run: each ~45-60 s, alphabetically near the end)
    "e2e/test_launch_slurm.py",
    "e2e/test_repro.py",
    "unit/test_kernels_triton.py",  # the interpreter: ~60 s on one worker (2026-12-05)
    "unit/test_kernel_budget.py",  # 14 compiles for sm_90 on both cores
    "unit/test_compile.py",  # ~20 s where inductor has never run (a fresh CI machine), ~5 s after
    "unit/test_mqar.py",  # a tiny model trained to recall: ~3-8 s
]


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a file, and among the other files, collection order
