"""A signal during start-up exits 75 with its message even when Python swallows the handler's exit or a
library has pointed standard error elsewhere for a moment."""

import subprocess
import sys
import textwrap

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
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert "Exception ignored" in result.stderr  # the fault as importlib's lock callback produced it
    assert "start-up went on" in result.stdout
    assert "training" not in result.stdout
    assert result.returncode == 75
    assert "SIGTERM during start-up; nothing to save, exit 75 (requeue)" in result.stderr


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
