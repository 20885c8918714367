"""Registering a dataset's shared-memory prefix in one atomic step, for streaming.

Streaming names every shared segment of a dataset ``{prefix:06}_{name}``; its ``get_shm_prefix``
has each rank scan for the first free prefix on its own, then the local leader creates the
prefix's ``locals`` segment after a barrier. Two jobs starting together on one node (two users'
jobs, or two test workers) race in that gap: both leaders pick the same prefix and the second
fails with ``FileExistsError: '/000335_locals'``, or another job registers between a rank's scan and
its leader's registration, and the ranks of one job disagree ("shared memory registered does not
match local leader"). Here only the local leader chooses: it creates ``locals`` exclusively (the
kernel's O_EXCL is the lock) and moves to the next prefix when another job got there first, and the
job's ranks learn its choice by an all-gather instead of each guessing by a scan of their own.

Streaming also leaves two empty lock files per dataset in the temporary directory
(``{prefix:06}_barrier_filelock``, ``_cache_filelock``) when the job ends, and every later dataset's
scan on the node skips each prefix that has them, two ``stat`` calls apiece: a node that had run
10,000 datasets spent ~0.8 s on the scan of each new one. The local leader removes its prefix's two
when its process exits normally (a killed job's stay, as streaming's own would).
"""

import atexit
import contextlib
import itertools
import os
from tempfile import gettempdir

import torch
import torch.distributed as dist
from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, LOCALS, SHM_TO_CLEAN
from streaming.base.shared import SharedMemory
from streaming.base.shared import prefix as streaming_prefix
from streaming.base.world import World


def get_shm_prefix(
    streams_local: list[str], streams_remote: list[str | None], world: World, retry: int = 100
) -> tuple[int, SharedMemory]:
    """Streaming's ``get_shm_prefix``, same arguments and result, without the race."""
    streaming_prefix._check_self(streams_local)
    # Streaming's scan still runs on every rank for its checks (a local directory reused by a live
    # dataset with a remote raises), and it says where the free prefixes begin.
    first_free = max(
        streaming_prefix._check_and_find_retrying(streams_local, streams_remote, shm_name=name, retry=retry)
        for name in SHM_TO_CLEAN
    )
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:  # every rank's scan done before its leader registers (it would see its own job)
        dist.barrier()
    prefix_int, shm = _claim(streams_local, first_free) if world.is_local_leader else (-1, None)
    if world.is_local_leader:
        atexit.register(_remove_file_locks, prefix_int)
    if distributed:
        prefix_int = _leaders_choice(prefix_int, world)
    elif not world.is_local_leader:
        raise RuntimeError(
            f"rank {world.rank} of {world.num_ranks} builds a dataset without torch.distributed: "
            "its local leader's shared-memory prefix cannot be learned"
        )
    if shm is None:
        shm = _attach(streams_local, prefix_int)
    return prefix_int, shm


def _claim(streams_local: list[str], prefix_int: int) -> tuple[int, SharedMemory]:
    """Create ``{prefix}_locals`` at the first prefix from ``prefix_int`` that nobody holds."""
    for candidate in itertools.count(prefix_int):
        locks = (streaming_prefix._get_path(candidate, name) for name in (BARRIER_FILELOCK, CACHE_FILELOCK))
        if any(os.path.exists(os.path.join(gettempdir(), lock)) for lock in locks):
            continue  # a live or killed job's file locks: streaming's scan skips these too
        data = streaming_prefix._pack_locals(streams_local, candidate)
        try:
            shm = SharedMemory(streaming_prefix._get_path(candidate, LOCALS), True, len(data))
        except FileExistsError:
            continue  # another job registered it since the scan
        shm.buf[: len(data)] = data
        return candidate, shm


def _remove_file_locks(prefix_int: int) -> None:
    """At the leader's exit: its dataset's lock files, which nobody else uses (the prefix's `locals`
    segment, held until now, kept every other job off it)."""
    for name in (BARRIER_FILELOCK, CACHE_FILELOCK):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(gettempdir(), streaming_prefix._get_path(prefix_int, name)))


def _leaders_choice(prefix_int: int, world: World) -> int:
    """Every rank's copy of its node's local leader's prefix (streaming numbers ranks node by node)."""
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # this rank's GPU: the dataset is built before DeepSpeed sets one
        from megabam.parallel.distributed import rank_device

        device = rank_device()
    mine = torch.tensor([prefix_int], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return int(every[world.node * world.ranks_per_node].item())


def _attach(streams_local: list[str], prefix_int: int) -> SharedMemory:
    name = streaming_prefix._get_path(prefix_int, LOCALS)
    try:
        shm = SharedMemory(name, False)
    except FileNotFoundError:
        raise RuntimeError(f"the local leader's shared memory {name} is gone before this rank attached") from None
    their_locals, their_prefix = streaming_prefix._unpack_locals(bytes(shm.buf))
    if their_locals != streams_local or their_prefix != prefix_int:
        raise RuntimeError(
            f"shared memory {name} records local directories {their_locals} (prefix {their_prefix}); "
            f"this rank's are {streams_local}: every rank must give the dataset the same local directories"
        )
    return shm
