"""One run per run directory: rank 0 holds an exclusive lock beside the directory for the whole run.

The lock is `flock` on OUTPUT_DIR/.NAME.lock, which the operating system releases when its holder
dies (kill -9 included), so a crashed run never leaves it stuck. The file records the holder's host
and PID, which the refusal of a second start names, and is removed when the run (or a refused start)
lets go of it.
"""

import fcntl
import os
import socket
from pathlib import Path

from megabam.errors import UserError


class RunDirError(UserError):
    """The run directory cannot be used as asked (never overwritten silently)."""


class RunLock:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.path = run_dir.with_name(f".{run_dir.name}.lock")
        self._file = None

    def try_acquire(self) -> str | None:
        """Take the lock; None when taken, else who holds it ("host H, pid P"). RunDirError when the
        output directory cannot hold it (read-only, not writable)."""
        while True:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                f = self.path.open("a+")
            except OSError as e:
                raise RunDirError(
                    self.path.parent, None, f"cannot write the run's lock there ({e.strerror or e})"
                ) from None
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().split()
                f.close()
                return f"host {holder[0]}, pid {holder[1]}" if len(holder) == 2 else "a process that has not said who"
            # The holder before removes the file as it lets go (release): a lock won on a file no longer
            # at the path guards nothing, so take the one there now.
            try:
                if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    break
            except FileNotFoundError:
                pass
            f.close()
        f.seek(0)
        f.truncate()
        f.write(f"{socket.gethostname()} {os.getpid()}\n")
        f.flush()
        self._file = f
        return None

    def acquire(self) -> "RunLock":
        holder = self.try_acquire()
        if holder is not None:
            raise RunDirError(
                self.run_dir, None, f"in use by another run ({holder}); wait for it to end or set run.name"
            )
        return self

    def release(self) -> None:
        if self._file is not None:
            self.path.unlink(missing_ok=True)  # while still held: nothing of a run (or a refused start) stays
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
