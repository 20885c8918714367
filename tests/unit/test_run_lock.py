"""The run directory's lock: one holder at a time, named to whoever is refused, and no file left once
it is let go — even while other processes keep trying for it."""

import multiprocessing
import os
import socket
import time

from megabam.train.run_lock import RunLock


def test_a_second_holder_is_refused_with_the_first_ones_name_and_release_leaves_nothing(tmp_path):
    run = tmp_path / "run"
    first = RunLock(run).acquire()
    assert (tmp_path / ".run.lock").read_text() == f"{socket.gethostname()} {os.getpid()}\n"
    assert RunLock(run).try_acquire() == f"host {socket.gethostname()}, pid {os.getpid()}"
    first.release()
    assert list(tmp_path.iterdir()) == []
    second = RunLock(run).acquire()
    second.release()
    assert list(tmp_path.iterdir()) == []


def _hold_in_turns(run, log, rounds):
    lock = RunLock(run)
    for _ in range(rounds):
        while lock.try_acquire() is not None:
            time.sleep(0.0005)
        with open(log, "a") as f:  # while holding: nobody else may write between these two lines
            f.write(f"in {os.getpid()}\n")
            f.flush()
            time.sleep(0.0005)
            f.write(f"out {os.getpid()}\n")
        lock.release()


def test_holders_taking_turns_never_overlap(tmp_path):
    """Three processes take the lock in turns while it is removed at every release: a lock won on a
    file just unlinked would let two hold it at once."""
    log = tmp_path / "log"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_hold_in_turns, args=(tmp_path / "run", log, 150)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    lines = log.read_text().splitlines()
    assert len(lines) == 2 * 3 * 150
    for a, b in zip(lines[::2], lines[1::2]):
        assert a.startswith("in ") and b == "out " + a[3:]
    assert not (tmp_path / ".run.lock").exists()
