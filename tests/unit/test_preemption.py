"""Signals: one during start-up exits 75 with its message even when Python swallows the handler's exit
or a library has pointed standard error elsewhere for a moment; Ctrl-C asks for a checkpoint and a
second one stops at once; `megabam launch` passes signals to its job and exits with the job's code."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import signal
    from megabam.train.preemption import PreemptionFlag, handle_start_up_signals

    handle_start_up_signals()

    class Collected:
        def __del__(self):
            # The handler runs inside __del__, where Python prints its SystemExit and ignores it.
            signal.raise_signal(signal.SIGTERM)

    Collected()
    print("start-up went on")
    with PreemptionFlag():
        print("training")
    """
)


def test_a_start_up_signal_whose_exit_was_swallowed_stops_before_the_first_step():
    """The handler's SystemExit is lost in a __del__; the start-up watcher (or, had it not run yet, the
    flag's check) still ends the process before the first step, saying why once."""
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert "training" not in result.stdout
    assert result.returncode == 75
    assert result.stderr.count("SIGTERM during start-up; nothing to save, exit 75 (requeue)") == 1


REDIRECTED = textwrap.dedent(
    """
    import os, signal, sys, tempfile
    from megabam.train.preemption import handle_start_up_signals

    handle_start_up_signals()
    # As DeepSpeed's OpBuilder.has_function does while it compiles a probe during start-up.
    probe = tempfile.NamedTemporaryFile("w", dir=sys.argv[1], delete=False)
    os.dup2(probe.fileno(), 2)
    signal.raise_signal(signal.SIGTERM)
    """
)


def test_a_start_up_signal_while_stderr_points_at_a_probe_file_still_says_why(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", REDIRECTED, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 75
    assert result.stderr == "megabam: SIGTERM during start-up; nothing to save, exit 75 (requeue)\n"
    (probe,) = tmp_path.iterdir()
    assert probe.read_text() == ""


FLAG = textwrap.dedent(
    """
    import signal
    from megabam.train.preemption import PreemptionFlag

    with PreemptionFlag() as flag:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)  # a preemption after Ctrl-C: still the user's stop
        print(flag.signal_name, flag.interrupted, flush=True)
        signal.raise_signal(signal.SIGINT)  # the second Ctrl-C: at once, no checkpoint
        print("not reached")
    """
)


def test_ctrl_c_asks_for_a_checkpoint_and_a_second_one_stops_at_once():
    result = subprocess.run([sys.executable, "-c", FLAG], capture_output=True, text=True, timeout=60)
    assert result.stdout == "SIGINT True\n"
    assert result.stderr == "megabam: a second SIGINT; stopping now without a checkpoint, exit 130\n"
    assert result.returncode == 130


PASSING = textwrap.dedent(
    """
    import sys
    from megabam.launch import run_passing_signals

    # The job: says which signal reached it (and exits with the code a rank would), or that its parent died.
    job = (
        'trap "echo TERM >> $0; exit 75" TERM; trap "echo USR1 >> $0" USR1; trap "echo INT >> $0; exit 130" INT; '
        'echo ready >> $0; while true; do sleep 0.05; done'
    )
    sys.exit(run_passing_signals(["bash", "-c", job, sys.argv[1]], {"PATH": "/usr/bin:/bin"}))
    """
)


@pytest.mark.parametrize(
    "signals, code, heard",
    [
        ([signal.SIGUSR1, signal.SIGTERM], 75, ["ready", "USR1", "TERM"]),
        ([signal.SIGINT], 130, ["ready", "INT"]),
        ([signal.SIGKILL], -9, ["ready", "TERM"]),  # the launcher killed outright: the job is told to stop
    ],
    ids=["term", "int", "kill"],
)
def test_the_launcher_passes_signals_to_its_job_and_exits_with_its_code(tmp_path, signals, code, heard):
    """`megabam launch`'s way of running a launch script, with real signals to its own PID."""
    log = tmp_path / "heard"
    proc = subprocess.Popen([sys.executable, "-c", PASSING, str(log)], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and "ready" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        for sig in signals:
            os.kill(proc.pid, sig)
            time.sleep(0.3)
        assert proc.wait(timeout=30) == code
        deadline = time.monotonic() + 10
        while log.read_text().split() != heard and time.monotonic() < deadline:
            time.sleep(0.05)
        assert log.read_text().split() == heard
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


SIGNALLED_WHILE_STARTING = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from megabam.launch import run_passing_signals

    class Starting(subprocess.Popen):
        \"\"\"The job is running, but a SIGTERM reaches the launcher before its Popen has returned.\"\"\"
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            while not os.path.exists(sys.argv[1]):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)

    subprocess.Popen = Starting
    job = 'trap "echo TERM >> $0; exit 75" TERM; echo ready >> $0; while true; do sleep 0.05; done'
    sys.exit(run_passing_signals(["bash", "-c", job, sys.argv[1]], {"PATH": "/usr/bin:/bin"}))
    """
)


def test_a_signal_while_the_job_starts_reaches_the_job(tmp_path):
    """Before the fix the launcher died of it (or, for SIGINT, of a KeyboardInterrupt inside Popen)
    and its job ran on, told nothing."""
    log = tmp_path / "heard"
    done = subprocess.run(
        [sys.executable, "-c", SIGNALLED_WHILE_STARTING, str(log)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 75, done.stderr[-2000:]
    assert log.read_text().split() == ["ready", "TERM"]


BLOCKED = textwrap.dedent(
    """
    import datetime
    from torch.distributed import TCPStore
    from megabam.train.preemption import handle_start_up_signals

    handle_start_up_signals()
    print("waiting", flush=True)
    # A rendezvous waiting for a peer that never comes: the main thread stays inside C++.
    TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=True,
             timeout=datetime.timedelta(seconds=60))
    print("not reached", flush=True)
    """
)


def test_a_start_up_signal_ends_a_rank_blocked_in_the_rendezvous_at_once(tmp_path):
    """Python runs handlers between bytecodes only; a rank blocked in C++ kept waiting for torchrun's
    SIGKILL 30 s later. The launch script reads the rank's code from MEGABAM_EXIT_CODE_DIR."""
    env = dict(os.environ, MEGABAM_EXIT_CODE_DIR=str(tmp_path), RANK="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline() == "waiting\n"
        time.sleep(0.5)  # inside the store's wait
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 75
        assert time.monotonic() - start < 10
        assert proc.stderr.read() == "megabam: SIGTERM during start-up; nothing to save, exit 75 (requeue)\n"
        assert (tmp_path / "rank1").read_text() == "75\n"
    finally:
        proc.kill()
