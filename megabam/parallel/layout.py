"""The parallel layout as the data path sees it: which ranks share samples.

Rank order convention for the whole project: global rank = ((dp · PP) + pp) · TP + tp, i.e.
tensor-parallel index fastest, then pipeline, then data-parallel. The TP × PP peers of one
data-parallel rank are therefore consecutive, and streaming's ``replication = TP · PP`` gives them
identical samples while data-parallel ranks get disjoint shares.
"""

from dataclasses import dataclass

from megabam.errors import LaunchError


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the data-, tensor- and pipeline-parallel dimensions (world = dp · tp · pp)."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1

    @property
    def world_size(self) -> int:
        return self.data * self.tensor * self.pipeline

    @property
    def replication(self) -> int:
        """Consecutive ranks that read identical samples."""
        return self.tensor * self.pipeline

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """Global rank of the process at data-parallel ``dp``, pipeline ``pp``, tensor ``tp``."""
        return (dp * self.pipeline + pp) * self.tensor + tp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) of global ``rank``; the inverse of ``rank``."""
        tp = rank % self.tensor
        pp = (rank // self.tensor) % self.pipeline
        return rank // (self.tensor * self.pipeline), pp, tp


def check_world(world: int, tensor: int, pipeline: int, data: int = 0) -> None:
    """Refuse a launched world size the config's layout does not describe (every rank does, at start)."""
    model_parallel = tensor * pipeline
    if data and world != data * model_parallel:
        raise LaunchError(
            "<launch>",
            "parallel.data",
            f"launched world size {world} is not parallel.data · tensor · pipeline = {data}·{tensor}·{pipeline} "
            f"= {data * model_parallel}",
        )
    if world % model_parallel:
        raise LaunchError(
            "<launch>",
            "parallel.tensor",
            f"world size {world} is not a multiple of parallel.tensor · parallel.pipeline = {model_parallel}",
        )
