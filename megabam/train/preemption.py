"""Preemption: SIGTERM / SIGUSR1 (SLURM sends one before the time limit) ask every rank to finish
its step, checkpoint, and exit with megabam.exit_codes.PREEMPTED so that launch scripts requeue the job."""

import os
import signal
import sys

from megabam import exit_codes

# The signal that arrived before the trainer's own handler was installed (exit_at_start_up).
_at_start_up: str | None = None
# The standard error this process started with, kept apart: during start-up DeepSpeed's compiler
# probes (OpBuilder.has_function) point file descriptor 2 at a temporary file they then delete, and a
# signal in that moment printed its message there (seen: exit 75 with no word why).
_stderr: int | None = None


def handle_start_up_signals() -> None:
    """Until PreemptionFlag takes over for the steps, SIGTERM/SIGUSR1 exit at once (exit_at_start_up)."""
    global _stderr
    if _stderr is None:
        _stderr = os.dup(2)
    for sig in PreemptionFlag.SIGNALS:
        signal.signal(sig, exit_at_start_up)


def exit_at_start_up(signum, frame) -> None:
    """SIGTERM/SIGUSR1 before the first step: nothing to save yet, so the requeued job simply starts
    again. PreemptionFlag takes over for the steps."""
    global _at_start_up
    _at_start_up = signal.Signals(signum).name
    message = f"megabam: {_at_start_up} during start-up; nothing to save, exit {exit_codes.PREEMPTED} (requeue)\n"
    # os.write, not print: the handler may interrupt a write to sys.stderr, whose buffer refuses a
    # second writer (RuntimeError: reentrant call).
    os.write(2 if _stderr is None else _stderr, message.encode())
    sys.exit(exit_codes.PREEMPTED)


class PreemptionFlag:
    """Set by the signal handler; read once per step (the trainer all-reduces it, since a signal may
    reach only some ranks, and every rank must stop after the same step)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        # Python ignores an exception raised by a handler that runs inside a weakref callback or a
        # __del__ (seen: importlib's module-lock callback while importing DeepSpeed), so start-up may
        # have carried on past exit_at_start_up's exit; stop here, before the first step.
        if _at_start_up is not None:
            self.__exit__()
            raise SystemExit(exit_codes.PREEMPTED)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


class Preempted(Exception):
    """Raised after the preemption checkpoint is written."""
