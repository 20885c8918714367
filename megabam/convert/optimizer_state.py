"""A checkpoint's ZeRO optimizer state read as full tensors per parameter, one parameter at a time.

DeepSpeed's ZeRO optimizer (stages 1 and 2, fp32 or bf16 training) keeps, per parameter group, one
flat fp32 buffer of master weights and one of each Adam moment, cut into equal partitions over the
data-parallel ranks. Each `[bf16_]zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt` holds one
partition of every group and, under "param_slice_mappings", where each parameter's fragment lies in
it (a parameter may straddle two partitions). A parameter's tensor-parallel shard is its fragments in
data-parallel order, reshaped; its full tensor is the shards put together by the tensor-parallel
plans (the same `tp_splits` the weights use). The model-parallel rank `mp` is pp · TP + tp.

Files are memory-mapped and read per parameter, with `weights_only=True` (DeepSpeed's three data
classes allowed by name: megabam/checkpoint/weights_only.py).
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from megabam.checkpoint.reader import CheckpointReader, load_weights_file
from megabam.checkpoint.shards import OPTIMIZER_FILE, model_states_file
from megabam.checkpoint.store import CheckpointError
from megabam.checkpoint.weights_only import WeightsOnlyCheckpointEngine
from megabam.parallel.pipeline_layers import decoder_name
from megabam.parallel.tensor_parallel import unshard
from megabam.train.optim import PLACEHOLDER

KINDS = ("fp32", "exp_avg", "exp_avg_sq")  # master weights and Adam's two moments


def zero_file(dp: int, mp: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"


def load_data_file(path: Path) -> dict:
    """A DeepSpeed optimizer file, memory-mapped (its three data classes allowed by name)."""
    return load_weights_file(path, WeightsOnlyCheckpointEngine.DATA_CLASSES)


@dataclass(frozen=True)
class Fragment:
    """Where a parameter's share of one data-parallel partition lies: file, group, offset, length."""

    file: str
    group: int
    start: int
    numel: int


@dataclass
class GroupState:
    """One AdamW parameter group as the schedule and the optimizer left it (megabam/train/optim.py names them)."""

    hyper: dict  # lr, initial_lr, betas, ... (everything but the parameters)
    base_lr: float  # the schedule's base learning rate of the group
    last_lr: float


@dataclass
class OptimizerState:
    """The optimizer state of checkpoint `reader`: full tensors per Decoder parameter (`full`), the Adam
    step, each group's hyperparameters and schedule, and DeepSpeed's step counters."""

    reader: CheckpointReader
    dp: int = 0  # data-parallel size the checkpoint was written at
    bf16: bool = False
    step: int = 0
    groups: dict[str, GroupState] = field(default_factory=dict)
    scheduler: dict = field(default_factory=dict)  # LambdaLR's state without the per-group lists
    counters: dict = field(default_factory=dict)  # global_steps, global_samples, skipped_steps
    fragments: dict[str, dict[int, list[Fragment]]] = field(default_factory=dict)  # name → tp rank → per dp

    @classmethod
    def read(cls, reader: CheckpointReader) -> "OptimizerState":
        """Index every partition file; a CheckpointError names the first missing or inconsistent one."""
        cfg, path = reader.config, reader.path
        if cfg.parallel.zero_stage == 0:
            raise CheckpointError(
                path,
                None,
                "written with parallel.zero_stage=0, whose optimizer state DeepSpeed keeps unpartitioned "
                "in its own per-index format; reshard reads ZeRO stage 1 or 2 checkpoints (consolidate and "
                "train.init_from carry the weights over, with a fresh optimizer)",
            )
        found = [m for m in map(OPTIMIZER_FILE.match, (p.name for p in path.iterdir())) if m]
        if not found:
            raise CheckpointError(path, None, "holds no ZeRO optimizer partitions (zero_pp_rank_*_optim_states.pt)")
        state = cls(reader, dp=1 + max(int(m[1]) for m in found), bf16=cfg.train.precision == "bf16")
        mp_size = reader.tp * reader.pp
        for mp in range(mp_size):
            state._read_model_parallel_rank(mp)
        trained = {name for name, p in reader.model.named_parameters() if p.requires_grad}
        missing = sorted(trained - set(state.fragments))
        if missing:
            raise CheckpointError(path, None, f"the optimizer partitions hold no state for {missing[0]}")
        return state

    def _read_model_parallel_rank(self, mp: int) -> None:
        """Index the partitions of model-parallel rank `mp` (all its data-parallel files, in order)."""
        reader, path = self.reader, self.reader.path
        tp = mp % reader.tp
        names, mine = None, {}
        for dp in range(self.dp):
            file = zero_file(dp, mp, self.bf16)
            if not (path / file).is_file():
                raise CheckpointError(
                    path / file,
                    None,
                    f"missing (the layout data={self.dp} × pipeline={reader.pp} × tensor={reader.tp} needs it)",
                )
            osd = load_data_file(path / file).get("optimizer_state_dict")
            try:
                mappings, base = osd["param_slice_mappings"], osd["base_optimizer_state"]
                groups = base["param_groups"]
                group_names = [g["name"] for g in groups]
                steps = {int(s["step"]) for s in base["state"].values()}
            except (KeyError, TypeError) as e:
                raise CheckpointError(path / file, None, f"not a ZeRO optimizer partition (no {e})") from None
            if names not in (None, group_names):
                raise CheckpointError(path / file, None, f"parameter groups {group_names}, other partitions {names}")
            names = group_names
            if len(steps) != 1 or (self.groups and self.step not in steps):
                raise CheckpointError(
                    path / file, None, f"Adam steps {sorted(steps)} disagree with the other partitions"
                )
            self.step = steps.pop()
            for g, mapping in enumerate(mappings):
                for key, address in mapping.items():
                    if key.startswith(PLACEHOLDER):  # a pipeline stage's empty-group stand-in (always 0)
                        continue
                    name = decoder_name(key, reader.layers)
                    if name not in reader.shapes:
                        raise CheckpointError(path / file, None, f"state for {key}, which the config's model has not")
                    mine.setdefault(name, []).append(Fragment(file, g, int(address.start), int(address.numel)))
            for group in groups:
                hyper = {k: v for k, v in group.items() if k != "params"}
                self.groups.setdefault(group["name"], GroupState(hyper, 0.0, 0.0))
        for name, fragments in mine.items():
            # The tied embedding is on the first and the last stage, its copies kept equal: the first's is read.
            self.fragments.setdefault(name, {}).setdefault(tp, fragments)
        engine = load_data_file(path / model_states_file(mp))
        try:
            schedule = dict(engine["lr_scheduler"])
            self.counters = {k: int(engine[k]) for k in ("global_steps", "global_samples", "skipped_steps")}
            lists = schedule.pop("base_lrs"), schedule.pop("_last_lr")
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(path / model_states_file(mp), None, f"no schedule or step counters ({e})") from None
        for name, base_lr, last_lr in zip(names, *lists):
            self.groups[name].base_lr, self.groups[name].last_lr = base_lr, last_lr
        self.scheduler = schedule

    def full(self, name: str) -> dict[str, Tensor]:
        """Master weights and moments of the trained parameter `name` as full fp32 tensors of its shape."""
        reader = self.reader
        split = reader.splits.get(name)
        shape = reader.piece_shape(name)
        shards: dict[str, list[Tensor]] = {kind: [] for kind in KINDS}
        for tp in range(reader.tp if split else 1):  # a replicated tensor: tensor rank 0's copy
            pieces: dict[str, list[Tensor]] = {kind: [] for kind in KINDS}
            for fragment in self.fragments[name].get(tp, []):
                osd = load_data_file(reader.path / fragment.file)["optimizer_state_dict"]
                flat = {
                    "fp32": osd["single_partition_of_fp32_groups"][fragment.group],
                    **osd["base_optimizer_state"]["state"][fragment.group],
                }
                for kind in KINDS:
                    pieces[kind].append(flat[kind].narrow(0, fragment.start, fragment.numel).clone())
                del osd, flat
            for kind in KINDS:
                joined = torch.cat(pieces[kind]) if pieces[kind] else torch.empty(0)
                if joined.numel() != torch.Size(shape).numel():
                    raise CheckpointError(
                        reader.path,
                        None,
                        f"the partitions hold {joined.numel()} values of {kind} for {name} "
                        f"on tensor rank {tp}, its shard has {torch.Size(shape).numel()}",
                    )
                shards[kind].append(joined.view(shape))
        return {kind: t[0] if split is None else unshard(t, split.dim, split.parts) for kind, t in shards.items()}

    def scheduler_state(self, group_names: list[str]) -> dict:
        """LambdaLR's state_dict for an optimizer whose groups are `group_names` (in its order)."""
        groups = [self.groups[n] for n in group_names]
        return dict(self.scheduler, base_lrs=[g.base_lr for g in groups], _last_lr=[g.last_lr for g in groups])
