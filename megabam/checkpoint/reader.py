"""A megabam checkpoint of any layout read as the full model's tensors, one tensor at a time.

The trainer's checkpoints hold DeepSpeed's files: per tensor-parallel rank `mp_rank_XX_model_states.pt`
(its shard of every weight under "module"), or under pipeline parallelism one file per pipeline layer
and tensor rank (megabam/parallel/pipeline_layers.py), plus the ZeRO optimizer partitions. Data
parallelism does not split the weights (ZeRO 0-2 partition only the optimizer state). The full
tensor of each name is put together from the tensor ranks' shards by the same split the tensor-
parallel plans declare (megabam/parallel/tensor_parallel.py `tp_splits`), and the names, shapes
and the set of tensors are those of the model that the checkpoint's config builds (on the meta
device: no memory). Files are memory-mapped and read per tensor, so reading the largest tensor
costs about its size, not the checkpoint's. Everything is read with `weights_only=True`.
"""

import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from megabam.checkpoint.shards import (
    LAYER_FILE,
    MODEL_STATES_FILE,
    OPTIMIZER_FILE,
    SHARD_KEY,
    identity_problem,
    layer_file,
    model_states_file,
    shard_identity,
)
from megabam.checkpoint.store import (
    META_FILE,
    CheckpointError,
    CheckpointMeta,
    checkpoint_root,
    list_tags,
    manifest_problems,
)
from megabam.config import Config, ConfigError
from megabam.config.loader import config_from_dict
from megabam.data.tokenizer import TOKENIZER_FILES, tokenizer_in
from megabam.model import Decoder
from megabam.parallel.pipeline_layers import TIED_HEAD, locate, pipeline_layers
from megabam.parallel.tensor_parallel import Split, shard, tp_splits, unshard


def find_checkpoint(path: Path) -> Path:
    """`path` itself when it is a checkpoint directory (holds megabam.json), else the newest
    checkpoint of the run directory `path` whose manifest verifies."""
    if not path.is_dir():
        raise CheckpointError(path, None, "no such run or checkpoint directory")
    if (path / META_FILE).is_file():
        problems = manifest_problems(path)
        if problems:
            raise CheckpointError(
                path, None, f"unusable ({problems if isinstance(problems, str) else '; '.join(problems)})"
            )
        return path
    tags = list_tags(path)
    if not tags:
        raise CheckpointError(path, None, "neither a checkpoint directory nor a run directory with checkpoints")
    skipped = []
    for tag in tags:
        problems = manifest_problems(checkpoint_root(path) / tag)
        if not problems:
            return checkpoint_root(path) / tag
        skipped.append(f"{tag}: {problems if isinstance(problems, str) else '; '.join(problems)}")
    raise CheckpointError(path, None, f"no checkpoint verifies ({' | '.join(skipped)})")


def load_weights_file(path: Path, data_classes: list | tuple = ()) -> dict:
    """A DeepSpeed file, memory-mapped, as plain tensors and data (nothing unpickled but the
    `data_classes` allowed by name)."""
    try:
        with torch.serialization.safe_globals(list(data_classes)):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as e:  # weights_only's refusal
        raise CheckpointError(path, None, f"not readable as weights ({str(e).splitlines()[0]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(path, None, f"expected a dict of tensors, got {type(state).__name__}")
    return state


@dataclass(frozen=True)
class Piece:
    """Where one tensor rank's share of a tensor lives: the file and the key in its weights."""

    file: str
    key: str


class CheckpointReader:
    """The checkpoint directory `path` (or a run directory's newest verified checkpoint): its
    metadata and config, its layout, and the full tensors of its model by name."""

    def __init__(self, path: str | Path):
        self.path = find_checkpoint(Path(path))
        self.meta = CheckpointMeta.read(self.path / META_FILE)
        try:
            self.config: Config = config_from_dict(self.meta.config, str(self.path / META_FILE))
        except ConfigError as e:
            raise CheckpointError(e.source, e.key, e.message) from None
        self.tp = self.config.parallel.tensor
        self.pp = self.config.parallel.pipeline
        with torch.device("meta"):
            self.model = Decoder(self.config.model)
        self.shapes = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        self.splits = tp_splits(self.model)
        self.layers = pipeline_layers(len(self.model.blocks), self.model.lm_head is None) if self.pp > 1 else None

    @property
    def run_dir(self) -> Path:
        return self.path.parent.parent

    def tokenizer_path(self) -> Path:
        """The run's tokenizer: beside the checkpoints (so a moved run still works), else where the
        run recorded it."""
        beside = tokenizer_in(self.run_dir)
        for candidate in (beside, Path(self.meta.tokenizer)):
            if candidate is not None and candidate.is_file():
                return candidate
        raise CheckpointError(
            self.path,
            None,
            f"its tokenizer is neither in {self.run_dir} ({' or '.join(TOKENIZER_FILES)}) nor {self.meta.tokenizer}",
        )

    def pieces(self, name: str) -> list[Piece]:
        """Each tensor rank's file and key of tensor `name` (a replicated tensor is on every rank too)."""
        if self.layers is None:
            return [Piece(model_states_file(r), f"module.{name}") for r in range(self.tp)]
        layer, key = locate(name, self.layers)
        return [Piece(layer_file(layer, r), key) for r in range(self.tp)]

    def files(self) -> list[str]:
        """Every weights file the layout implies, in order."""
        if self.layers is None:
            return [model_states_file(r) for r in range(self.tp)]
        return [layer_file(i, r) for i, name in enumerate(self.layers) if name != TIED_HEAD for r in range(self.tp)]

    def piece_shape(self, name: str) -> tuple[int, ...]:
        """The shape of one tensor rank's share of `name`."""
        shape = self.shapes[name]
        split = self.splits.get(name)
        if split is None:
            return shape
        return tuple(shard(torch.empty(shape, device="meta"), split.dim, 0, self.tp, split.parts).shape)

    def _weights(self, file: str) -> dict:
        state = load_weights_file(self.path / file)
        self._check_identity(file, state)
        if self.layers is None:
            module = state.get("module")
            if not isinstance(module, dict):
                raise CheckpointError(self.path / file, None, "holds no 'module' weights")
            return {f"module.{k}": v for k, v in module.items()}
        return state

    def _check_identity(self, file: str, state: dict) -> None:
        """The rank, layer and layout the file's writer recorded against its name and the config."""
        if self.layers is None:
            expected = shard_identity(int(MODEL_STATES_FILE.match(file).group(1)), self.tp, self.pp)
        else:
            layer, rank = LAYER_FILE.match(file).groups()
            expected = shard_identity(int(rank), self.tp, self.pp, layer=int(layer))
        problem = identity_problem(state.get(SHARD_KEY), expected)
        if problem:
            raise CheckpointError(self.path / file, None, problem)

    def check(self) -> None:
        """Every file the layout needs is there and holds exactly the tensors the config's model has, of
        the shapes its split gives: a CheckpointError naming the first file and tensor that do not."""
        wanted: dict[str, dict[str, tuple]] = {}
        for name in self.shapes:
            for piece in self.pieces(name):
                wanted.setdefault(piece.file, {})[piece.key] = self.piece_shape(name)
        for file in self.files():
            wanted.setdefault(file, {})
        for file, keys in wanted.items():
            if not (self.path / file).is_file():
                raise CheckpointError(
                    self.path / file, None, f"missing (the layout tensor={self.tp}, pipeline={self.pp} needs it)"
                )
            found = {k: tuple(v.shape) for k, v in self._weights(file).items() if isinstance(v, Tensor)}
            for key, shape in keys.items():
                if key not in found:
                    raise CheckpointError(
                        self.path / file, None, f"has no tensor {_shown(key)} (the config's model has it)"
                    )
                if found[key] != shape:
                    raise CheckpointError(
                        self.path / file,
                        None,
                        f"{_shown(key)} has shape {list(found[key])}, the config's model {list(shape)}",
                    )
            extra = sorted(set(found) - set(keys))
            if extra:
                raise CheckpointError(
                    self.path / file, None, f"holds {_shown(extra[0])}, which the config's model has not"
                )

    def tensor(self, name: str) -> Tensor:
        """The full tensor `name` as stored (its training dtype), put together from its shards."""
        split: Split | None = self.splits.get(name)
        pieces = []
        for piece in self.pieces(name)[: 1 if split is None else None]:
            weights = self._weights(piece.file)
            if piece.key not in weights:
                raise CheckpointError(self.path / piece.file, None, f"has no tensor {_shown(piece.key)}")
            pieces.append(weights[piece.key].clone())  # out of the mapped file, which closes with `weights`
            del weights
        full = pieces[0] if split is None else unshard(pieces, split.dim, split.parts)
        if tuple(full.shape) != self.shapes[name]:
            raise CheckpointError(
                self.path, None, f"{name} has shape {list(full.shape)}, the config's model {list(self.shapes[name])}"
            )
        return full

    def state_dict(self) -> dict[str, Tensor]:
        """Every tensor of the model, full (for loading into a one-process `Decoder`)."""
        return {name: self.tensor(name) for name in self.shapes}

    def optimizer_files(self) -> list[str]:
        """The ZeRO optimizer partitions present (zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt)."""
        return sorted(p.name for p in self.path.iterdir() if OPTIMIZER_FILE.match(p.name))


def _shown(key: str) -> str:
    """A key as messages name it: the model's tensor name (without the engine file's "module.")."""
    return key.removeprefix("module.")
