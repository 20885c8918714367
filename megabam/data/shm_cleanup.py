"""Removing the shared memory that killed jobs left in /dev/shm, without touching what a live process
still uses.

Streaming's segments outlive a job killed outright (kill -9 during start-up left 46 of them in one
afternoon), and its own clean_stale_shared_memory() unlinks every streaming segment on the machine,
live jobs' included. Here a segment is stale unless a live process other than this one maps it
(/proc/PID/maps lists every mapped /dev/shm file); this process's own segments go, as streaming's
cleanup would take them (a dataset no longer used). Only this user's segments are candidates: other
users' processes' maps are not readable, so their segments could not be told live.

A segment nobody maps is also spared while it is young (MIN_AGE_S): its creator may be between
creating the file and mapping it (shm_open, ftruncate, mmap), as another job starting on the node
can be at any moment. A young orphan goes at the next cleanup. Training cleans at start
(megabam/train/trainer.py); the tests clean between tests, run two at a time.
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


def _owned(path: str) -> bool:
    try:
        return os.stat(path).st_uid == os.getuid()
    except FileNotFoundError:
        return False


def _age_s(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return 0.0


def remove_stale(pattern: str, only: set[str] | None = None, mine_too: bool = True) -> int:
    """Unlink the files of this user matching `pattern` (among `only`, when given) that no other process
    maps (nor this one, unless `mine_too`); return how many went.

    The files are listed before the processes' maps are read: a segment created after the list is
    never a candidate, and one listed is mapped by its creator before the scan reaches it (streaming
    maps a segment in the call that creates it) unless it was listed between its creation and its
    mapping, when its age spares it. Listed after the scan, a segment a leader created during the
    scan counted as stale and went, and its job's other rank failed to attach (seen once in 885
    tests: FileNotFoundError '/000075_epoch_data')."""
    candidates = {path for path in glob.glob(pattern) if _owned(path)}
    live = mapped_by_others()
    mine = _mapped("/proc/self/maps")
    if not mine_too:
        live |= mine
    removed = 0
    for path in candidates - live:
        if (only is None or path in only) and (path in mine or _age_s(path) >= MIN_AGE_S):
            try:
                os.remove(path)
                removed += 1
            except FileNotFoundError:  # another cleanup was first
                pass
    return removed


def clean_streaming(mine_too: bool = True) -> int:
    """Streaming's stale segments; a job's start keeps its own (`mine_too=False`), the tests' cleanup
    between tests takes them."""
    return remove_stale(STREAMING, mine_too=mine_too)
