"""A signal during start-up exits 75 even when Python swallows the handler's exit."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import signal
    from megabam.train.preemption import PreemptionFlag, exit_at_start_up

    signal.signal(signal.SIGTERM, exit_at_start_up)

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
