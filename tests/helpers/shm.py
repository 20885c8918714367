"""Removing shared memory that killed or finished processes left in /dev/shm, without touching
what a live process of another test still uses.

Streaming's own clean_stale_shared_memory() unlinks every streaming segment on the machine, so
with tests run two at a time (pytest-xdist `-n 2`) a cleanup in one test would pull the state out
from under a training of the other. Here a segment is stale unless a live process other than this one
maps it (/proc/PID/maps lists every mapped /dev/shm file); this process's own segments go, as
streaming's cleanup would take them (a dataset of the test that is no longer used).

A segment nobody maps is also spared while it is young (MIN_AGE_S): its creator may be between
creating the file and mapping it (shm_open, ftruncate, mmap), as a job of another test worker, or of
a second copy of the suite on the same machine, can be at any moment. A young orphan goes at the next
cleanup.
"""

import glob
import os
import re
import time

# streaming's segments: /dev/shm/<6-digit prefix>_<name> (streaming/base/shared/prefix.py)
STREAMING = "/dev/shm/[0-9][0-9][0-9][0-9][0-9][0-9]_*"
DEEPSPEED = "/dev/shm/deepspeed_allreduce_buffer_*"
MIN_AGE_S = 5.0


def _mapped(maps: str) -> set[str]:
    try:
        text = open(maps).read()
    except OSError:  # the process ended while we looked
        return set()
    return set(re.findall(r"(/dev/shm/\S+)$", text, flags=re.MULTILINE))


def mapped_by_others() -> set[str]:
    """/dev/shm files mapped by any live process but this one."""
    me = str(os.getpid())
    return set().union(*(_mapped(maps) for maps in glob.glob("/proc/[0-9]*/maps") if maps.split("/")[2] != me))


def _age_s(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return 0.0


def remove_stale(pattern: str, only: set[str] | None = None) -> None:
    """Unlink the files matching `pattern` (among `only`, when given) that no other process maps.

    The files are listed before the processes' maps are read: a segment created after the list is
    never a candidate, and one listed is mapped by its creator before the scan reaches it (streaming
    maps a segment in the call that creates it) unless it was listed between its creation and its
    mapping, when its age spares it. Listed after the scan, a segment a leader created during the
    scan counted as stale and went, and its job's other rank failed to attach (seen once in 885
    tests: FileNotFoundError '/000075_epoch_data')."""
    candidates = set(glob.glob(pattern))
    live = mapped_by_others()
    mine = _mapped("/proc/self/maps")
    for path in candidates - live:
        if (only is None or path in only) and (path in mine or _age_s(path) >= MIN_AGE_S):
            try:
                os.remove(path)
            except FileNotFoundError:  # another test's cleanup was first
                pass


def clean_streaming() -> None:
    remove_stale(STREAMING)
