"""megabam's lock on DeepSpeed's op folder (megabam/parallel/distributed.py): a rank that finds it held
says what it waits for after FIRST_NOTE_S, again every NOTE_EVERY_S seconds, and enters soon after the holder leaves (on
every multi-rank start all but one rank wait for a holder that only loads the built op)."""

import fcntl
import logging
import threading
import time
import types

from megabam.parallel import distributed


def test_a_waiter_polls_often_says_what_it_waits_for_and_enters_when_the_holder_leaves(tmp_path, monkeypatch, caplog):
    holder = (tmp_path / ".megabam-build.lock").open("a+")
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: as another process's lock
    threading.Timer(0.4, lambda: fcntl.flock(holder, fcntl.LOCK_UN)).start()
    sleeps = []
    fake_time = types.SimpleNamespace(monotonic=time.monotonic, sleep=lambda s: (sleeps.append(s), time.sleep(s)))
    monkeypatch.setattr(distributed, "time", fake_time)
    monkeypatch.setattr(distributed, "FIRST_NOTE_S", 0.1)
    monkeypatch.setattr(distributed, "NOTE_EVERY_S", 0.15)
    with caplog.at_level(logging.WARNING, logger=distributed.__name__):
        with distributed.extension_build_lock(tmp_path):
            # inside: the holder has left, and nobody else may enter
            other = (tmp_path / ".megabam-build.lock").open("a+")
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("the lock was not held inside the block")
            except BlockingIOError:
                pass
            finally:
                other.close()
    holder.close()
    notes = [r.getMessage() for r in caplog.records if "waiting for another megabam process" in r.getMessage()]
    assert 2 <= len(notes) <= 3 and str(tmp_path) in notes[0], notes  # at 0.1 s, then every 0.15 s of 0.4
    assert sleeps and set(sleeps) == {distributed.LOCK_POLL_S} and distributed.LOCK_POLL_S <= 0.1
    assert len(sleeps) >= 0.3 / distributed.LOCK_POLL_S  # it kept trying through the holder's 0.4 s
