"""Process-wide set-up that megabam's entry points share: the start-up's garbage collection,
DeepSpeed's accelerator on a machine without CUDA, and a signal when the parent dies. torch's threads
and the denormal flush are set when a rank joins its process group (megabam/parallel/threads.py
`configure_cpu`, which sizes them by the ranks sharing the node)."""

import gc
import os
import sys


def begin() -> None:
    """The first thing a megabam process does (megabam.cli.run)."""
    # Start-up imports (torch, DeepSpeed, the trainer) build millions of long-lived objects; each full
    # collection while they grow walks all of them, and the interpreter's last collection at exit walks
    # them again. No collections during start-up, and those objects frozen after it (start_collecting),
    # took a tiny training run from 5.0 to 4.1 s (docs/benchmarks.md, "Test suite"). Not frozen at exit
    # too (0.3 s more): objects of extensions (Triton's) left uncollected make them print leak warnings.
    gc.disable()


def cpu_accelerator_without_cuda() -> None:
    """DeepSpeed's accelerator is CPU where torch sees no CUDA device (before DeepSpeed is imported; a
    value the user set wins)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def start_collecting() -> None:
    """The end of a process's start-up (megabam.cli.run holds the garbage collector until here; so do
    tools/bench_cpu_train.py's cases): what the imports built lives as long as the process, so the
    collector is told to skip it from now on, then resumes. A no-op where collections were never held
    (main called in-process, by tests)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def parent_death_signal(sig: int) -> None:
    """Ask the kernel to send this process `sig` when its parent dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
