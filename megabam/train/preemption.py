"""Preemption: SIGTERM / SIGUSR1 (SLURM sends one before the time limit) ask every rank to finish
its step, checkpoint, and exit with megabam.exit_codes.PREEMPTED so that launch scripts requeue the job."""

import signal


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
