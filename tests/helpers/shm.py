"""Removing shared memory that killed or finished processes left in /dev/shm, without touching
what a live process of another test still uses.

Streaming's own clean_stale_shared_memory() unlinks every streaming segment on the machine, so
with tests run two at a time (pytest-xdist `-n 2`) a cleanup in one test would pull the state out
from under a training of the other. Here a segment is stale unless a live process other than this one
maps it (/proc/PID/maps lists every mapped /dev/shm file); this process's own segments go, as
streaming's cleanup would take them (a dataset of the test that is no longer used).
"""

import glob
import os
import re

# streaming's segments: /dev/shm/<6-digit prefix>_<name> (streaming/base/shared/prefix.py)
STREAMING = "/dev/shm/[0-9][0-9][0-9][0-9][0-9][0-9]_*"
DEEPSPEED = "/dev/shm/deepspeed_allreduce_buffer_*"


def mapped_by_others() -> set[str]:
    """/dev/shm files mapped by any live process but this one."""
    mapped = set()
    me = str(os.getpid())
    for maps in glob.glob("/proc/[0-9]*/maps"):
        if maps.split("/")[2] == me:
            continue
        try:
            text = open(maps).read()
        except OSError:  # the process ended while we looked
            continue
        mapped.update(re.findall(r"(/dev/shm/\S+)$", text, flags=re.MULTILINE))
    return mapped


def remove_stale(pattern: str, only: set[str] | None = None) -> None:
    """Unlink the files matching `pattern` (among `only`, when given) that no other process maps.

    The files are listed before the processes' maps are read: a segment created after the list is
    never a candidate, and one listed is mapped by its creator before the scan reaches it (streaming
    maps a segment in the call that creates it). Listed after the scan, a segment a leader created
    during the scan counted as stale and went, and its job's other rank failed to attach (seen once
    in 885 tests: FileNotFoundError '/000075_epoch_data')."""
    candidates = set(glob.glob(pattern))
    live = mapped_by_others()
    for path in candidates - live:
        if only is None or path in only:
            try:
                os.remove(path)
            except FileNotFoundError:  # another test's cleanup was first
                pass


def clean_streaming() -> None:
    remove_stale(STREAMING)
