"""Running a test's function on several gloo ranks, each a fresh process started the way the trainer
starts (the launcher's environment variables, then `init_distributed`): megabam's own local world,
one torch thread per rank."""

import torch

from megabam.parallel.distributed import run_local_world


def _one_thread(fn, args) -> None:
    torch.set_num_threads(1)
    fn(*args)


def spawn(world: int, fn, *args) -> None:
    """Run fn(*args) on `world` gloo ranks; an exception in any rank fails the test with its traceback."""
    run_local_world(world, _one_thread, fn, args)
