"""Running a test's function on several gloo ranks, each a fresh process (torch.multiprocessing spawn)
started the way the trainer starts: the launcher's environment variables, then `init_distributed`."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megabam.parallel.distributed import free_port, init_distributed, rank_environment


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    torch.set_num_threads(1)
    os.environ.update(rank_environment(rank, world, port), DS_ACCELERATOR="cpu")
    init_distributed()
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn, *args) -> None:
    """Run fn(*args) on `world` gloo ranks; an exception in any rank fails the test with its traceback."""
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, start_method="spawn")
