"""Checkpoints: DeepSpeed's layout (model, ZeRO-partitioned optimizer, scheduler) plus megabam's
metadata beside it as JSON — step, tokens, data-loader position, resolved config, tokenizer path,
wandb run id. Nothing megabam writes needs unpickling to read.

    run_dir/checkpoints/latest               tag of the newest checkpoint (written by DeepSpeed last)
    run_dir/checkpoints/step_00000100/       DeepSpeed files + megabam.json
"""
import json
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

META_FILE = "megabam.json"


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


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save(engine, run_dir: Path, step: int, meta: dict) -> Path:
    """Collective: every rank writes its shard; rank 0 writes the metadata."""
    tag = f"step_{step:08d}"
    root = checkpoint_root(run_dir)
    engine.save_checkpoint(str(root), tag=tag)
    if dist.get_rank() == 0:
        tmp = root / tag / (META_FILE + ".tmp")
        tmp.write_text(json.dumps(dict(meta, step=step), indent=1))
        tmp.rename(root / tag / META_FILE)
    dist.barrier()
    return root / tag


def latest_tag(run_dir: Path) -> Optional[str]:
    pointer = checkpoint_root(run_dir) / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


def load(engine, run_dir: Path) -> Optional[dict]:
    """Restore the engine from the newest checkpoint and return its metadata (None if there is none)."""
    tag = latest_tag(run_dir)
    if tag is None:
        return None
    meta_path = checkpoint_root(run_dir) / tag / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path}: checkpoint metadata missing; the checkpoint is incomplete")
    load_path, _ = engine.load_checkpoint(str(checkpoint_root(run_dir)), tag=tag)
    if load_path is None:
        raise FileNotFoundError(f"{checkpoint_root(run_dir) / tag}: DeepSpeed could not load this checkpoint")
    return json.loads(meta_path.read_text())
