"""Preemption: SIGTERM / SIGUSR1 (SLURM sends one before the time limit) ask every rank to finish
its step, checkpoint, and exit with megabam.exit_codes.PREEMPTED so that launch scripts requeue the job;
SIGINT (Ctrl-C) does the same and exits with exit_codes.INTERRUPTED (130, not requeued), and a second
SIGINT aborts at once."""

import os
import signal
import sys
import threading

from megabam import exit_codes

# The signal that arrived before the trainer's own handler was installed (exit_at_start_up).
_at_start_up: str | None = None
# The standard error this process started with, kept apart: during start-up DeepSpeed's compiler
# probes (OpBuilder.has_function) point file descriptor 2 at a temporary file they then delete, and a
# signal in that moment printed its message there (seen: exit 75 with no word why).
_stderr: int | None = None
_started = False  # PreemptionFlag took over: the steps began
_announced: list[str] = []
_announce_lock = threading.RLock()  # a handler may interrupt its own thread holding it


def exit_code(signal_name: str) -> int:
    """75 (requeue) for a scheduler's SIGTERM/SIGUSR1, 130 for the user's SIGINT."""
    return exit_codes.INTERRUPTED if signal_name == "SIGINT" else exit_codes.PREEMPTED


def exit_words(code: int) -> str:
    """How a stop by signal ends its line: the code, and whether a launch script requeues the job."""
    return f"exit {code}" + (" (requeue)" if code == exit_codes.PREEMPTED else "")


def _say(message: str) -> None:
    # os.write, not print: a handler may interrupt a write to sys.stderr, whose buffer refuses a second
    # writer (RuntimeError: reentrant call).
    os.write(2 if _stderr is None else _stderr, f"{message}\n".encode())


def handle_start_up_signals() -> None:
    """Until PreemptionFlag takes over for the steps, its signals exit at once (exit_at_start_up), also
    while the main thread is inside a blocking call (_watch_start_up)."""
    global _stderr
    for sig in PreemptionFlag.SIGNALS:
        signal.signal(sig, exit_at_start_up)
    if _stderr is None:  # once per process
        _stderr = os.dup(2)
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=_watch_start_up, args=(read,), name="megabam-start-up-signals", daemon=True).start()


def _watch_start_up(wakeup: int) -> None:
    """Python runs a signal's handler in the main thread between two bytecodes only, so a rank blocked
    in C++ (the process-group rendezvous waiting for a peer that already left, an op build) ignored
    SIGTERM until torchrun killed it 30 s later. The interpreter's own C handler writes each signal's
    number to the wakeup pipe at once: this thread reads it and ends the process during start-up."""
    while byte := os.read(wakeup, 1):
        if byte[0] in PreemptionFlag.SIGNALS and not _started:
            exit_codes.record(_announce(signal.Signals(byte[0]).name))
            os._exit(exit_code(signal.Signals(byte[0]).name))


def exit_at_start_up(signum, frame) -> None:
    """A signal before the first step: nothing to save yet, so a requeued job simply starts again.
    PreemptionFlag takes over for the steps."""
    global _at_start_up
    _at_start_up = signal.Signals(signum).name
    sys.exit(_announce(_at_start_up))


def _announce(name: str) -> int:
    """Say that signal `name` stopped the start-up (once, whoever sees it first); its exit code."""
    code = exit_code(name)
    with _announce_lock:
        if not _announced:
            _announced.append(name)
            _say(f"megabam: {name} during start-up; nothing to save, {exit_words(code)}")
    return code


class PreemptionFlag:
    """Set by the signal handler; read once per step (the trainer all-reduces it, since a signal may
    reach only some ranks, and every rank must stop after the same step)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}

    def __enter__(self):
        global _started
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        _started = True
        # Python ignores an exception raised by a handler that runs inside a weakref callback or a
        # __del__ (seen: importlib's module-lock callback while importing DeepSpeed), so start-up may
        # have carried on past exit_at_start_up's exit; stop here, before the first step.
        if _at_start_up is not None:
            self.__exit__()
            raise SystemExit(exit_code(_at_start_up))
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.interrupted:  # the user insists: no checkpoint, no waiting for one
            _say(f"megabam: a second SIGINT; stopping now without a checkpoint, exit {exit_codes.INTERRUPTED}")
            os._exit(exit_codes.INTERRUPTED)
        if self.signal_name != "SIGINT":  # Ctrl-C wins over a preemption: the user asked the run to stop
            self.signal_name = name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    @property
    def interrupted(self) -> bool:
        return self.signal_name == "SIGINT"


class Preempted(Exception):
    """Raised after the checkpoint a signal asked for is written: args (step, exit code)."""
