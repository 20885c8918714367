"""DeepSpeed's checkpoint reads made safe: every file goes through `torch.load(weights_only=True)`.

Kept apart from megabam/checkpoint/store.py so that reading checkpoints for evaluation and conversion
does not import DeepSpeed.
"""

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch engine, but loading with `weights_only=True`: a checkpoint is data
    (tensors, numbers, strings, containers), never code to unpickle. The ZeRO optimizer state also
    holds three of DeepSpeed's plain data classes, allowed by name."""

    DATA_CLASSES = [LossScaler, ZeroStageEnum, fragment_address]

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(self.DATA_CLASSES):
            return torch.load(path, map_location=map_location, weights_only=True)


def use_weights_only_loading(engine) -> None:
    """Every DeepSpeed checkpoint read (model, ZeRO shards) goes through `engine.checkpoint_engine`."""
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)
