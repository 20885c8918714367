"""A run directory with one checkpoint written by hand (no training, no DeepSpeed), laid out as the
trainer lays it out: checkpoints/step_N/{mp_rank_XX_model_states.pt, megabam.json, manifest.json}
beside tokenizer.model, one weights file per tensor-parallel rank holding the shards `apply_tp` takes.
For the evaluation, plot and conversion tests."""

import copy
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from megabam.checkpoint.store import MANIFEST_FILE, META_FILE, CheckpointMeta, _digest, tag_for
from megabam.config import load_config
from megabam.data.corpus import python_stdlib_documents
from megabam.data.tokenizer import train_tokenizer
from megabam.model import Decoder
from megabam.parallel.tensor_parallel import apply_tp

from .runs import CONFIG

TINY = ["model.vocab_size=512", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "data.seq_len=64"]
TINY += ["data.passkey_min_tokens=null"]  # the main job's shortest passkey document does not fit in 64


def write_run(
    root: Path, *overrides: str, step: int = 10, tokenizer_from: Path | None = None, seed: int = 0
) -> tuple[Path, Decoder]:
    """`root` as a run directory holding a freshly initialised model (from `seed`) of tiny_cpu.yaml +
    TINY + overrides as its checkpoint at `step` (beside any it holds); returns the run directory and
    the model written."""
    cfg = load_config(CONFIG, [*TINY, *overrides])
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = root / "tokenizer.model"
    if tokenizer_from is not None:
        tokenizer.write_bytes(tokenizer_from.read_bytes())
    else:
        train_tokenizer(python_stdlib_documents(300_000), tokenizer, vocab_size=cfg.model.vocab_size)
    torch.manual_seed(seed)
    model = Decoder(cfg.model)
    ckpt = root / "checkpoints" / tag_for(step)
    ckpt.mkdir(parents=True)
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    model = model.to(dtype)
    for rank in range(cfg.parallel.tensor):
        weights = shard_model(model, rank, cfg.parallel.tensor).state_dict()
        torch.save({"module": weights}, ckpt / f"mp_rank_{rank:02d}_model_states.pt")
    meta = CheckpointMeta(
        step=step,
        tokens=step * 1000,
        samples=step,
        loader={},
        config=dataclasses.asdict(cfg),
        skipped_steps=0,
        tokenizer=str(tokenizer),
        wandb_id=None,
        window_sampler=None,
    )
    (ckpt / META_FILE).write_text(meta.to_json())
    resign(ckpt)
    (root / "checkpoints" / "latest").write_text(tag_for(step))
    return root, model.eval()


def resign(ckpt: Path) -> None:
    """Make the manifest vouch for the checkpoint folder as it now is (what a careless copy tool or a
    forger does)."""
    files = {p.name: _digest(p) for p in ckpt.iterdir() if p.is_file() and p.name != MANIFEST_FILE}
    (ckpt / MANIFEST_FILE).write_text(json.dumps({"files": files}))


def shard_model(model: Decoder, rank: int, size: int) -> Decoder:
    """Tensor rank `rank`'s part of `model` (a copy) as apply_tp makes it on that rank (no process group
    is needed to build it)."""
    if size == 1:
        return model
    return apply_tp(copy.deepcopy(model), SimpleNamespace(tp_rank=rank, tp_size=size, tp_group=None))
