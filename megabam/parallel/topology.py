"""The one owner of the data × pipeline × tensor layout and its torch.distributed process groups.

Rank order is the project's (megabam/parallel/layout.py): global rank = ((dp · PP) + pp) · TP + tp, so
tensor-parallel peers are consecutive ranks (on a cluster they share a node, where their per-layer
all-reduces are cheap). No other module creates process groups: they ask a `Topology`.
"""

import torch.distributed as dist

from megabam.parallel.layout import ParallelLayout, check_world


class Topology:
    """This process's coordinates in `layout` and the groups it belongs to.

    `dist.new_group` is collective over the whole world and must be called in the same order on
    every rank, even for groups a rank is not in, so the constructor creates every tensor-, pipeline-
    and data-parallel group of the layout and keeps the three that contain this rank.
    """

    def __init__(self, layout: ParallelLayout):
        if not dist.is_initialized():
            raise RuntimeError("Topology needs an initialised torch.distributed process group")
        world = dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(
                f"world size {world} is not data·pipeline·tensor = "
                f"{layout.data}·{layout.pipeline}·{layout.tensor} = {layout.world_size}"
            )
        self.layout = layout
        self.rank = dist.get_rank()
        self.dp_rank, self.pp_rank, self.tp_rank = layout.coordinates(self.rank)
        self.tp_group = self._own_group(self.tensor_groups())
        self.pp_group = self._own_group(self.pipeline_groups())
        self.dp_group = self._own_group(self.data_groups())

    def tensor_groups(self) -> list[list[int]]:
        """Ranks of every tensor-parallel group: same (dp, pp), tp = 0..TP-1 (consecutive ranks)."""
        L = self.layout
        return [[L.rank(dp, pp, tp) for tp in range(L.tensor)] for dp in range(L.data) for pp in range(L.pipeline)]

    def pipeline_groups(self) -> list[list[int]]:
        """Ranks of every pipeline: same (dp, tp), stages pp = 0..PP-1 in order."""
        L = self.layout
        return [[L.rank(dp, pp, tp) for pp in range(L.pipeline)] for dp in range(L.data) for tp in range(L.tensor)]

    def data_groups(self) -> list[list[int]]:
        """Ranks of every data-parallel group: same (pp, tp), dp = 0..DP-1 (the ranks ZeRO shards over)."""
        L = self.layout
        return [[L.rank(dp, pp, tp) for dp in range(L.data)] for pp in range(L.pipeline) for tp in range(L.tensor)]

    def _own_group(self, all_ranks: list[list[int]]):
        own = None
        for ranks in all_ranks:
            group = dist.new_group(ranks)
            if self.rank in ranks:
                own = group
        return own

    @property
    def tp_size(self) -> int:
        return self.layout.tensor

    @property
    def pp_size(self) -> int:
        return self.layout.pipeline

    @property
    def dp_size(self) -> int:
        return self.layout.data


def build_topology(tensor: int, pipeline: int, data: int = 0) -> Topology:
    """The layout of this launch: tensor and pipeline sizes from the config, data parallelism from the
    rest of the world (or from the config, when it names one the world must match)."""
    world = dist.get_world_size()
    check_world(world, tensor, pipeline, data)
    return Topology(ParallelLayout(data=world // (tensor * pipeline), tensor=tensor, pipeline=pipeline))
