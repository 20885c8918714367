"""Joining the process group, and the one free-port helper."""

import os
import socket

import deepspeed
import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port on loopback that no process is listening on (at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables a launcher (torchrun, the deepspeed launcher) gives rank `rank` of a one-node
    world of `world` processes rendezvousing on 127.0.0.1:`port`."""
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def init_distributed() -> None:
    """Join the process group that torchrun / the deepspeed launcher describe in the environment.

    A plain `megabam train` is given a one-rank world on loopback, so the same DeepSpeed path runs
    with one process as with many. All five variables are set together: DeepSpeed falls back to MPI
    discovery (and replaces MASTER_ADDR) when any is missing.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])  # streaming reads it
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
