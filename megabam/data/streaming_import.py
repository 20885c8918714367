"""The one place megabam imports mosaicml-streaming."""

import fcntl
import functools
import logging
import os
import sys
import tempfile
import time
import types
from pathlib import Path

log = logging.getLogger(__name__)
# One per node, where streaming's segments live (the shared-memory namespace); flock, so a holder
# killed by any signal releases it.
PREFIX_LOCK = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) / "megabam-streaming-prefix.lock"
NOTE_EVERY_S = 10


def import_streaming() -> types.ModuleType:
    """Return the ``streaming`` module, importable without a working torchvision.

    ``streaming/__init__.py`` eagerly imports ``streaming.vision`` and ``streaming.multimodal``,
    which import torchvision, and ``streaming.text``, which imports transformers' AutoTokenizer
    (and with it scikit-learn and torch.distributed.tensor: 2-5 s of every training process's
    start). On the CPU stack torchvision is absent, or installed but unable to load beside CPU
    torch, so ``import streaming`` would fail. megabam uses only ``streaming.base`` (the dataset,
    the MDS writer), so empty stand-ins for the three are registered before the first import.
    """
    if "streaming" not in sys.modules:
        for name in ("streaming.vision", "streaming.multimodal", "streaming.text"):
            sys.modules.setdefault(name, types.ModuleType(name))
    import streaming
    import streaming.base.dataset as dataset_module

    if not hasattr(dataset_module.get_shm_prefix, "megabam_locked"):
        dataset_module.get_shm_prefix = _one_job_at_a_time(dataset_module.get_shm_prefix)
    return streaming


def _one_job_at_a_time(get_shm_prefix):
    """Streaming's registration of a dataset's shared-memory prefix, one job of the node at a time.

    Its local leader finds the first free prefix, waits at a barrier for its own ranks, then creates
    the segment: two jobs starting together on one node both find the same prefix and the second
    fails with `FileExistsError: '/000335_locals'` (seen with two test workers). The leader holds a
    node-wide lock over the registration; the other ranks do not take it (they wait at the barriers
    for their leader, which would otherwise wait for them)."""

    @functools.wraps(get_shm_prefix)
    def locked(streams_local, streams_remote, world, *args, **kwargs):
        if not world.is_local_leader:
            return get_shm_prefix(streams_local, streams_remote, world, *args, **kwargs)
        try:
            fd = os.open(PREFIX_LOCK, os.O_RDONLY | os.O_CREAT, 0o666)
        except OSError:  # another user's lock we may not open: as streaming alone would
            return get_shm_prefix(streams_local, streams_remote, world, *args, **kwargs)
        try:
            note_at = time.monotonic()
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= note_at:
                        log.warning(f"waiting for another job on this node to register its dataset ({PREFIX_LOCK})")
                        note_at += NOTE_EVERY_S
                    time.sleep(0.05)
            return get_shm_prefix(streams_local, streams_remote, world, *args, **kwargs)
        finally:
            os.close(fd)  # releases the lock

    locked.megabam_locked = True
    return locked
