"""The optimizer state of a run's checkpoint as DeepSpeed itself holds it after loading: every rank
builds its part of the layout as the trainer does, DeepSpeed loads the checkpoint (the trainer's
checkpoint.load), and each parameter's fp32 master weights and Adam moments are gathered over the
data-parallel ranks by DeepSpeed's own `safe_get_full_*`. Saved per (Decoder name, tensor rank), with
the Adam step: the oracle of the reshard tests, which never reads the files through megabam/convert.
Several checkpoints of the same world size (any layouts) load one after the other in one launch.

    python -m torch.distributed.run --standalone --nproc-per-node=N optimizer_dump.py CKPT OUT.pt [CKPT OUT.pt ...]
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402
from parallel_logits import loaded_engine  # noqa: E402  (beside this script)

from megabam.parallel.pipeline_layers import decoder_name, pipeline_layers  # noqa: E402
from megabam.train.optim import PLACEHOLDER  # noqa: E402


def dump(ckpt: Path, out: Path) -> None:
    cfg, topology, engine = loaded_engine(ckpt)
    ds = engine.deepspeed
    ds.optimizer._lazy_init_hp_params_optimizer_state()  # DeepSpeed links the moments at the first step
    layers = pipeline_layers(cfg.model.n_layers, cfg.model.tie_embeddings) if topology.pp_size > 1 else None
    mine = {}
    for key, param in ds.module.named_parameters():
        if param.requires_grad and not key.startswith(PLACEHOLDER):
            state = {"fp32": safe_get_full_fp32_param(param)}
            state |= {kind: safe_get_full_optimizer_state(param, kind) for kind in ("exp_avg", "exp_avg_sq")}
            mine[f"{decoder_name(key, layers)}@{topology.tp_rank}"] = {k: v.detach().clone() for k, v in state.items()}
    steps = {int(s["step"]) for s in ds.optimizer.optimizer.state.values()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine if topology.dp_rank == 0 else {})
    if dist.get_rank() == 0:
        torch.save({"steps": sorted(steps), "params": {k: v for part in gathered for k, v in part.items()}}, out)
    dist.barrier()


if __name__ == "__main__":
    for ckpt, out in zip(sys.argv[1::2], sys.argv[2::2]):
        dump(Path(ckpt), Path(out))
    dist.destroy_process_group()
