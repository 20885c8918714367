"""Process-wide set-up that every megabam entry point shares."""

import gc


def start_collecting() -> None:
    """The end of a process's start-up (megabam.cli.run holds the garbage collector until here; so do
    tools/bench_cpu_train.py's cases): what the imports built lives as long as the process, so the
    collector is told to skip it from now on, then resumes. A no-op where collections were never held
    (main called in-process, by tests)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
