"""A trained model for evaluation and plots, read from a run directory, one checkpoint directory of
any parallel layout (megabam/checkpoint/reader.py puts the full tensors together from the tensor and
pipeline ranks' files), a consolidated folder (`megabam convert consolidate`) or a megabam Hugging
Face export (`convert to-hf`). A checkpoint's manifest is verified first; weights are read with
`weights_only=True` (plain tensors, nothing unpickled), and DeepSpeed is not imported.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from megabam.checkpoint.reader import CheckpointReader
from megabam.checkpoint.store import CheckpointError, CheckpointMeta, tag_for
from megabam.config import Config
from megabam.data.tokenizer import Tokenizer, load_tokenizer
from megabam.model import Decoder


@dataclass
class Trained:
    model: Decoder
    tokenizer: Tokenizer
    config: Config
    meta: CheckpointMeta
    checkpoint: Path  # the checkpoint directory, or the consolidated folder
    run_dir: Path  # where outputs go by default (the consolidated folder itself)

    @property
    def tag(self) -> str:
        """step_NNNNNNNN: what output files are named after."""
        return tag_for(self.meta.step)


def load_trained(path: str | Path, device: str | torch.device = "cpu") -> Trained:
    """The model (eval mode, float32), tokenizer and config of a run directory's newest verified
    checkpoint, of the checkpoint directory `path`, or of the consolidated folder `path`."""
    from megabam.checkpoint.consolidated import is_consolidated, read_consolidated
    from megabam.convert.hf_import import is_export, read_export

    if is_consolidated(Path(path)) or is_export(Path(path)):
        folder = read_consolidated(Path(path)) if is_consolidated(Path(path)) else read_export(Path(path))
        model, config, meta, tokenizer = folder.model, folder.config, folder.meta, folder.tokenizer
        checkpoint = run_dir = Path(path)
        if tokenizer is None:  # a model imported without one (from-hf of a bare Llama)
            raise CheckpointError(
                path, None, "has no tokenizer (tokenizer.model or tokenizer.json), which evaluation needs"
            )
    else:
        reader = CheckpointReader(path)
        config, meta, checkpoint, run_dir = reader.config, reader.meta, reader.path, reader.run_dir
        tokenizer = reader.tokenizer_path()
        reader.check()
        model = Decoder(config.model)
        model.load_state_dict(reader.state_dict())
    return Trained(model.float().to(device).eval(), load_tokenizer(tokenizer), config, meta, checkpoint, run_dir)
