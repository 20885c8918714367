"""The `Topology` seen through DeepSpeed's model-parallel-unit ("mpu") interface.

`deepspeed.initialize(..., mpu=DeepSpeedMpu(topology))` makes ZeRO partition and average over the
data-parallel group only, names checkpoint files per tensor-parallel rank (mp_rank_XX), and sums the
gradient norm over the tensor-parallel group (parameters marked `tensor_model_parallel` on every
rank, replicated ones on tensor rank 0 only). DeepSpeed's "model parallel" means tensor parallel
here. With pipeline parallelism this class is not used: the pipeline module brings DeepSpeed's own
grid, built from the same layout (megabam/parallel/pipeline.py).
"""

import torch.distributed as dist

from megabam.parallel.topology import Topology


class DeepSpeedMpu:
    def __init__(self, topology: Topology):
        self.topology = topology

    def get_data_parallel_group(self):
        return self.topology.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.topology.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.topology.dp_size

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.topology.dp_group)

    def get_model_parallel_group(self):
        return self.topology.tp_group

    def get_model_parallel_rank(self) -> int:
        return self.topology.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.topology.tp_size

    def get_tensor_model_parallel_group(self):
        return self.topology.tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.topology.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.topology.tp_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of tensor rank 0 in this rank's group."""
        return dist.get_global_rank(self.topology.tp_group, 0)
