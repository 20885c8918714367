"""Joining the process group (with DeepSpeed's JIT-built ops under megabam's own lock), and a local
world of processes for conversions."""

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from megabam.parallel.ranks import free_port, launch_environment, rank_environment
from megabam.parallel.threads import configure_cpu

log = logging.getLogger(__name__)
NOTE_EVERY_S = 30  # how long a start-up wait may last before it says again what it waits for
# How often a rank waiting for the build lock tries it again, and when it first says so. Once the op is
# built a holder only loads it (~0.1 s), so on every multi-rank start all but one rank wait that long:
# polling each second made them wait a whole second (docs/benchmarks.md, "Test suite"), and a note on
# every start would be noise.
LOCK_POLL_S = 0.05
FIRST_NOTE_S = 1.0


def init_distributed() -> None:
    """Join the process group that torchrun / the deepspeed launcher describe in the environment.

    Whichever launcher started this process (torchrun, deepspeed, mpirun, srun; megabam/parallel/ranks.py
    reads them all), torch's six variables are set together before DeepSpeed looks: it falls back to
    its own MPI discovery (and replaces MASTER_ADDR) when any is missing. A plain `megabam train` is
    the one rank of a world on loopback, so the same DeepSpeed path runs with one process as with many.
    """
    if dist.is_initialized():
        return
    os.environ.update(launch_environment())  # LOCAL_WORLD_SIZE too: streaming and the thread count read it
    configure_cpu()  # before any parallel work: ranks sharing a node must not oversubscribe its cores
    # Built (first start: ~20 s) or loaded under the lock, but outside the rendezvous: a rank holding
    # the lock while it waits for the others to join would wait for ever on those waiting for the lock.
    build_ops()
    world = int(os.environ["WORLD_SIZE"])
    if world > 1:  # the rendezvous waits for every rank; say so before waiting
        log.info(
            f"joining the {world} ranks at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
            f"(waiting up to {deepspeed.constants.default_pg_timeout} for all of them)"
        )
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)


def rank_device() -> torch.device:
    """This rank's device: GPU LOCAL_RANK of the node where CUDA is present, else the CPU."""
    return torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")


def build_ops() -> None:
    """DeepSpeed's ops that joining needs, built now (the first time: ~20 s) or loaded, under megabam's
    lock in its extensions folder. Also run at install (megabam/prebuild.py)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(default_extensions_dir()))
    with extension_build_lock(Path(os.environ["TORCH_EXTENSIONS_DIR"])):
        _build_deepspeed_cpu_op()


def _build_deepspeed_cpu_op() -> None:
    """The shared-memory communication op DeepSpeed's CPU backend loads in init_distributed (the same
    builder and compatibility test), so that init_distributed finds it built. Nothing on a GPU."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load(verbose=False)


def default_extensions_dir() -> Path:
    """megabam's folder for DeepSpeed's JIT-built ops, one per environment (Python, torch and DeepSpeed
    versions, and where the environment lives): torch's default is shared by every environment of one
    Python, which then rebuild it in turn — two checkouts' venvs with the same versions too, since the
    op's sources are paths inside each venv (seen with two copies of the test suite running at once:
    each start of one rebuilt the op the other had just built)."""
    cache = Path(os.environ.get("MEGABAM_CACHE") or "~/.cache/megabam").expanduser()
    python = f"py{sys.version_info.major}.{sys.version_info.minor}"
    env = hashlib.sha1(str(Path(sys.prefix).resolve()).encode()).hexdigest()[:8]
    return cache / "torch_extensions" / f"{python}-torch{torch.__version__}-deepspeed{deepspeed.__version__}-{env}"


@contextlib.contextmanager
def extension_build_lock(folder: Path):
    """Hold megabam's lock on `folder` (flock, released by the OS when its holder dies, kill -9 too)
    while DeepSpeed may build in it. Holding it, no other megabam process is building there, so the
    `lock` file torch's builder leaves when killed mid-build (on which every later start would wait
    for ever, silently) is stale: it is removed, with a message. A wait for another process's build
    says what it waits for after FIRST_NOTE_S, then every NOTE_EVERY_S seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".megabam-build.lock").open("a+") as f:
        note_at = time.monotonic() + FIRST_NOTE_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= note_at:
                    log.warning(f"waiting for another megabam process that is building DeepSpeed's ops in {folder}")
                    note_at = time.monotonic() + NOTE_EVERY_S
                time.sleep(LOCK_POLL_S)
        try:
            for stale in folder.glob("*/lock"):
                log.warning(f"removed a stale build lock {stale} (left by a process killed while building)")
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _local_rank_entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(rank_environment(rank, world, port), DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    init_distributed()
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def run_local_world(world: int, fn, *args) -> None:
    """Run fn(*args) on `world` fresh gloo processes on this machine's CPU, joined as the trainer joins
    (for conversions that need a layout's engine). The first rank to fail stops the others and raises
    torch.multiprocessing's ProcessRaisedException (its traceback) or ProcessExitedException here."""
    import torch.multiprocessing as mp

    mp.start_processes(_local_rank_entry, args=(world, free_port(), fn, args), nprocs=world, start_method="spawn")
