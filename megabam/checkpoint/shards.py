"""Which file of a checkpoint holds which shard: DeepSpeed's file names, and the identity each
weights file records of the rank and layout that wrote it.

Every weights file records which rank of which layout wrote it (`SHARD_KEY`): a file copied over
another tensor rank's, or another layer's, holds tensors of the right names and shapes and would
otherwise load, or merge, into wrong weights without a word. Engine files carry it in DeepSpeed's
client state (megabam/checkpoint/store.py); pipeline layer files, which DeepSpeed writes as plain
state dicts, through the state-dict hooks of `record_layer_identity`.
"""

import re
from functools import partial

from torch import nn

MODEL_STATES_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
OPTIMIZER_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def model_states_file(model_parallel_rank: int) -> str:
    """DeepSpeed's per-model-parallel-rank engine file (with the weights under "module" without PP)."""
    return f"mp_rank_{model_parallel_rank:02d}_model_states.pt"


def layer_file(layer: int, tp_rank: int) -> str:
    """DeepSpeed's file of pipeline layer `layer` on tensor rank `tp_rank` (PipelineModule.ckpt_layer_path)."""
    return f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


SHARD_KEY = "megabam_shard"


def shard_identity(tensor_rank: int, tensor: int, pipeline: int, layer: int | None = None) -> dict:
    """What a weights file records of its writer: its tensor rank, the layout, and (a pipeline
    layer's file) the layer."""
    identity = {"tensor_rank": tensor_rank, "tensor": tensor, "pipeline": pipeline}
    return identity if layer is None else {**identity, "layer": layer}


def identity_problem(recorded, expected: dict) -> str | None:
    """Why a file recording `recorded` cannot stand where `expected` belongs; None when it can (or
    records nothing: checkpoints written before the record)."""
    if not recorded or recorded == expected:
        return None
    return f"written as {_described(recorded)}, not {_described(expected)} (a file copied over another?)"


def _described(identity) -> str:
    if not isinstance(identity, dict):
        return repr(identity)[:80]
    get = identity.get
    where = f"layer {get('layer')} of " if "layer" in identity else ""
    return f"{where}tensor rank {get('tensor_rank')} of a tensor={get('tensor')}, pipeline={get('pipeline')} layout"


def record_layer_identity(pipeline: nn.Module, tp_rank: int, tp_size: int, pp_size: int) -> None:
    """Each of this stage's layer files records its layer and tensor rank (DeepSpeed saves a layer's
    `state_dict()`); a file recording another is noted as it loads, in `pipeline.identity_problems`.
    Noted, not raised: a rank raising inside DeepSpeed's load would leave the others in its collectives."""
    pipeline.identity_problems = []
    for index, layer in enumerate(pipeline.forward_funcs, start=pipeline._local_start):
        if isinstance(layer, nn.Module):
            mine = shard_identity(tp_rank, tp_size, pp_size, layer=index)
            layer.register_state_dict_post_hook(partial(_add_identity, mine))
            layer.register_load_state_dict_pre_hook(partial(_check_identity, mine, pipeline.identity_problems))


def _add_identity(mine: dict, module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    state[prefix + SHARD_KEY] = mine


def _check_identity(mine: dict, problems: list[str], module: nn.Module, state: dict, prefix: str, *rest) -> None:
    problem = identity_problem(state.pop(prefix + SHARD_KEY, None), mine)
    if problem:
        problems.append(f"layer {mine['layer']}'s file was {problem}")
