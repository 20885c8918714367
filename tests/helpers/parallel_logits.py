"""The logits of a run's checkpoint computed by the parallel model that trained it: every rank builds
its part of the layout as the trainer does (build_engine), DeepSpeed loads the checkpoint (the
trainer's checkpoint.load), and the model runs a fixed batch of token ids, stage by stage under
pipeline parallelism, its vocabulary shards gathered. The oracle of the consolidation tests: it
reads the checkpoint through DeepSpeed, not through megabam/convert.

    python -m torch.distributed.run --standalone --nproc-per-node=N parallel_logits.py CKPT OUT.pt
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megabam.checkpoint import store  # noqa: E402
from megabam.checkpoint.weights_only import use_weights_only_loading  # noqa: E402
from megabam.config.loader import config_from_dict  # noqa: E402
from megabam.parallel.distributed import init_distributed  # noqa: E402
from megabam.parallel.topology import build_topology  # noqa: E402
from megabam.train.engine import build_engine  # noqa: E402

BATCH, LENGTH, SEED = 2, 48, 5


def token_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, LENGTH), generator=torch.Generator().manual_seed(SEED))


def loaded_engine(ckpt: Path):
    """(config, topology, engine) of checkpoint `ckpt` on this rank: built as the trainer builds it,
    then loaded by DeepSpeed through the trainer's store.load."""
    init_distributed()
    meta = store.CheckpointMeta.read(ckpt / store.META_FILE)
    cfg = config_from_dict(meta.config, str(ckpt))
    topology = build_topology(cfg.parallel.tensor, cfg.parallel.pipeline)
    engine = build_engine(cfg, topology)
    use_weights_only_loading(engine.deepspeed)
    store.load(engine.deepspeed, ckpt.parent.parent, ckpt.name)
    return cfg, topology, engine


@torch.no_grad()
def main(ckpt: Path, out: Path) -> None:
    cfg, topology, engine = loaded_engine(ckpt)
    module = engine.deepspeed.module
    module.eval()
    ids = token_ids(cfg.model.vocab_size)
    doc_ids = torch.zeros_like(ids)
    if topology.pp_size == 1:
        logits = module(ids)  # without labels: the full logits (the vocabulary shards gathered)
    else:
        L, last = topology.layout, topology.pp_size - 1
        x = (ids, doc_ids)
        if topology.pp_rank > 0:
            states = torch.empty(BATCH, LENGTH, cfg.model.d_model)
            dist.recv(states, src=L.rank(topology.dp_rank, topology.pp_rank - 1, topology.tp_rank))
            x = (states, doc_ids)
        y = module(x)
        if topology.pp_rank < last:
            dist.send(y[0].contiguous(), dst=L.rank(topology.dp_rank, topology.pp_rank + 1, topology.tp_rank))
            logits = None
        else:
            shards = [torch.empty_like(y) for _ in range(topology.tp_size)]
            dist.all_gather(shards, y.contiguous(), group=topology.tp_group)
            logits = torch.cat(shards, -1)
    if logits is not None and topology.dp_rank == 0 and topology.tp_rank == 0:
        torch.save(logits, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
