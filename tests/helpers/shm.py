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
    """Unlink the files matching `pattern` (among `only`, when given) that no other process maps."""
    live = mapped_by_others()
    for path in set(glob.glob(pattern)) - live:
        if only is None or path in only:
            try:
                os.remove(path)
            except FileNotFoundError:  # another test's cleanup was first
                pass


def clean_streaming() -> None:
    remove_stale(STREAMING)
