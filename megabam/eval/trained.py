"""A trained model for evaluation and plots, read from a run directory or one checkpoint directory.

Evaluation runs in one process, so it reads checkpoints whose model lives whole in one file: a
layout without tensor or pipeline parallelism (any data parallelism and ZeRO stage 0-2 qualify;
the optimizer state is not read). The checkpoint's manifest is verified first; the weights are read
with `weights_only=True` (plain tensors, nothing unpickled).
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from megabam.config import Config, ConfigError
from megabam.config.loader import config_from_dict
from megabam.data.tokenizer import Tokenizer
from megabam.model import Decoder
from megabam.train.checkpoint import (
    META_FILE,
    CheckpointError,
    CheckpointMeta,
    checkpoint_root,
    list_tags,
    manifest_problems,
)

MODEL_FILE = "mp_rank_00_model_states.pt"  # DeepSpeed's name for the (only) model-parallel rank's weights


@dataclass
class Trained:
    model: Decoder
    tokenizer: Tokenizer
    config: Config
    meta: CheckpointMeta
    checkpoint: Path
    run_dir: Path


def find_checkpoint(path: Path) -> Path:
    """`path` itself when it is a checkpoint directory (holds megabam.json), else the newest
    checkpoint of the run directory `path` whose manifest verifies."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such run or checkpoint directory")
    if (path / META_FILE).is_file():
        problems = manifest_problems(path)
        if problems:
            raise CheckpointError(
                f"{path}: unusable ({problems if isinstance(problems, str) else '; '.join(problems)})"
            )
        return path
    tags = list_tags(path)
    if not tags:
        raise CheckpointError(f"{path}: neither a checkpoint directory nor a run directory with checkpoints")
    skipped = []
    for tag in tags:
        problems = manifest_problems(checkpoint_root(path) / tag)
        if not problems:
            return checkpoint_root(path) / tag
        skipped.append(f"{tag}: {problems if isinstance(problems, str) else '; '.join(problems)}")
    raise CheckpointError(f"{path}: no checkpoint verifies ({' | '.join(skipped)})")


def load_trained(path: str | Path, device: str | torch.device = "cpu") -> Trained:
    """The model (eval mode, float32), tokenizer and config of a run directory's newest verified
    checkpoint, or of the checkpoint directory `path`."""
    checkpoint = find_checkpoint(Path(path))
    meta = CheckpointMeta.read(checkpoint / META_FILE)
    try:
        config = config_from_dict(meta.config, str(checkpoint / META_FILE))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    layout = config.parallel
    if layout.tensor > 1 or layout.pipeline > 1:
        raise CheckpointError(
            f"{checkpoint}: trained with parallel.tensor={layout.tensor}, parallel.pipeline={layout.pipeline}; "
            "evaluation reads checkpoints whose model is whole in one file (tensor = pipeline = 1)"
        )
    run_dir = checkpoint.parent.parent
    tokenizer_path = run_dir / "tokenizer.model"  # beside the checkpoints, so a moved run still works
    if not tokenizer_path.is_file():
        tokenizer_path = Path(meta.tokenizer)
    if not tokenizer_path.is_file():
        raise CheckpointError(
            f"{checkpoint}: its tokenizer is neither {run_dir / 'tokenizer.model'} nor {meta.tokenizer}"
        )
    try:
        state = torch.load(checkpoint / MODEL_FILE, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as e:
        raise CheckpointError(
            f"{checkpoint / MODEL_FILE}: not readable as weights ({str(e).splitlines()[0]})"
        ) from None
    weights = state.get("module") if isinstance(state, dict) else None
    if not isinstance(weights, dict):
        raise CheckpointError(f"{checkpoint / MODEL_FILE}: holds no 'module' weights")
    model = Decoder(config.model)
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise CheckpointError(
            f"{checkpoint / MODEL_FILE}: does not fit its config ({str(e).splitlines()[0]})"
        ) from None
    model = model.float().to(device).eval()
    return Trained(model, Tokenizer(tokenizer_path), config, meta, checkpoint, run_dir)
