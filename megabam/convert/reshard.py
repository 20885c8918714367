"""`megabam convert reshard CKPT OUT --tp T --pp P [--dp D]`: a checkpoint re-split for another layout,
with everything a resumed run needs.

OUT is a run directory (config.yaml at the new layout, the tokenizer, the metrics so far, one
checkpoint) that `megabam train OUT/config.yaml` on T·P·D ranks resumes. What it holds is written by
DeepSpeed itself: T·P·D local gloo processes each build the new layout's engine as the trainer does
(build_engine: the same tensor-parallel plans and pipeline cut), fill their parameters, fp32 master
weights and Adam moments from the source's full tensors (megabam/checkpoint/reader.py and
optimizer_state.py: read per parameter and re-split by `tp_splits`, the plans' own record of how each
tensor is cut), set the Adam step, the schedule and DeepSpeed's counters, restore an RNG state, and
save through the trainer's `checkpoint.save` with the source's data-loader position and window sampler.

Data order: streaming draws the same global sample order at any data-parallel size (its canonical
nodes are fixed at 1, megabam/data/loader.py) as long as each step reads the same number of samples,
so a change of D keeps micro_batch_size and scales train.grad_accum to keep the global batch (or is
refused when it cannot). Per-rank RNG states: rank (dp, pp, tp) gets the source rank at the same
coordinates, clamped to the source layout (training draws nothing random after initialisation).

Everything is checked before anything is written; the output appears only once complete.
"""

import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch

from megabam.checkpoint.reader import CheckpointReader
from megabam.checkpoint.shards import shard_identity
from megabam.checkpoint.store import CheckpointError, checkpoint_root, list_tags
from megabam.config.loader import config_from_dict, save_config
from megabam.convert.optimizer_state import KINDS, OptimizerState
from megabam.data.tokenizer import copy_tokenizer, load_tokenizer
from megabam.errors import BadArgument
from megabam.parallel.layout import ParallelLayout
from megabam.progress import Progress, note
from megabam.staging import check_output, staged_folder

SOURCE = "<reshard>"


def target_config(
    reader: CheckpointReader, tp: int, pp: int, dp: int, source_dp: int, zero_stage: int | None, out: Path
) -> tuple[dict, list[str]]:
    """The source run's config at the new layout (validated), and the changes besides the layout."""
    raw = dataclasses.asdict(reader.config)
    par, train, notes = raw["parallel"], raw["train"], []
    if zero_stage is not None and zero_stage != par["zero_stage"]:
        if zero_stage not in (1, 2):
            raise BadArgument(None, "--zero-stage", f"must be 1 or 2 (the partitioned optimizer), got {zero_stage}")
        notes.append(f"parallel.zero_stage {par['zero_stage']} → {zero_stage}")
        par["zero_stage"] = zero_stage
    if pp != par["pipeline"] and par["pipeline_boundaries"]:
        notes.append(f"parallel.pipeline_boundaries {par['pipeline_boundaries']} → [] (balanced by parameters)")
        par["pipeline_boundaries"] = []
    if tp == 1 and par["sequence_parallel"]:
        notes.append("parallel.sequence_parallel true → false (it needs tensor > 1)")
        par["sequence_parallel"] = False
    par["tensor"], par["pipeline"] = tp, pp
    if par["data"] and par["data"] != dp:  # a fixed data-parallel size must name the new one
        notes.append(f"parallel.data {par['data']} → {dp}")
        par["data"] = dp
    micro_batches = source_dp * train["grad_accum"]  # per step, over all data-parallel ranks
    if micro_batches % dp:
        raise BadArgument(
            None,
            "--dp",
            f"{dp} does not divide the {micro_batches} micro-batches of a step (data {source_dp} × "
            f"train.grad_accum {train['grad_accum']}); the data order needs the same global batch",
        )
    if micro_batches // dp != train["grad_accum"]:
        notes.append(f"train.grad_accum {train['grad_accum']} → {micro_batches // dp} (the same global batch)")
        train["grad_accum"] = micro_batches // dp
    raw["run"]["output_dir"], raw["run"]["name"] = str(out.parent.resolve()), out.name
    config_from_dict(raw, SOURCE)  # every rule of the trainer's config (heads, vocabulary, stages ...)
    return raw, notes


def reshard(
    source: Path,
    out: Path,
    tp: int,
    pp: int,
    dp: int | None = None,
    zero_stage: int | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Write the run directory `out` from checkpoint (or run directory) `source` at data `dp` (default:
    the source's) × pipeline `pp` × tensor `tp`; returns the summary lines."""
    start = time.perf_counter()
    reader = CheckpointReader(source)
    check_output(out, overwrite, reader.path)
    reader.check()
    state = OptimizerState.read(reader)
    dp = state.dp if dp is None else dp
    for flag, n in (("--tp", tp), ("--pp", pp), ("--dp", dp)):
        if n < 1:
            raise BadArgument(None, flag, f"must be at least 1, got {n}")
    raw, notes = target_config(reader, tp, pp, dp, state.dp, zero_stage, out)
    tokenizer = reader.tokenizer_path()
    for rank in range(state.dp * reader.tp * reader.pp):
        if not (reader.path / f"rng_rank{rank:05d}.json").is_file():
            raise CheckpointError(reader.path / f"rng_rank{rank:05d}.json", None, f"missing (rank {rank}'s RNG state)")
    world = tp * pp * dp
    with staged_folder(out, replace=overwrite) as tmp:
        save_config(config_from_dict(raw, SOURCE), tmp / "config.yaml")
        copied = copy_tokenizer(load_tokenizer(tokenizer), tmp)
        metrics = reader.run_dir / "metrics.jsonl"
        if metrics.is_file():  # the resumed run drops its rows past the checkpoint (and any cut short)
            shutil.copyfile(metrics, tmp / "metrics.jsonl")
        note(
            f"reshard: building data {dp} × pipeline {pp} × tensor {tp} on {world} local process(es), each reading "
            "its share of the weights and optimizer state (progress: rank 0's)"
        )
        _run_ranks(out, world, str(reader.path), str(tmp), raw, str(out / copied.name))
        written = list_tags(tmp)
        if not written:
            raise CheckpointError(tmp, None, "the ranks finished without writing a checkpoint")
    lines = [
        f"resharded {reader.path} (step {reader.meta.step}; "
        f"data {state.dp} × pipeline {reader.pp} × tensor {reader.tp})",
        f"into {checkpoint_root(out) / written[0]} (data {dp} × pipeline {pp} × tensor {tp}) in "
        f"{time.perf_counter() - start:.1f} s: weights, fp32 master weights, Adam moments and step "
        f"{state.step}, schedule, data position, window sampler, RNG",
        *(f"changed: {note}" for note in notes),
        f"resume with: launch/torchrun.sh {world} {out / 'config.yaml'}",
    ]
    return lines


def _run_ranks(out: Path, world: int, *args) -> None:
    """write_rank on `world` local processes; a rank's failure is one line naming it (and `out`, the folder
    being written)."""
    import torch.multiprocessing as mp

    from megabam.parallel.distributed import run_local_world

    try:
        run_local_world(world, write_rank, *args)
    except mp.ProcessRaisedException as e:
        last = [line for line in str(e).strip().splitlines() if line.strip()][-1]
        raise CheckpointError(
            out, None, f"writing the resharded checkpoint failed on rank {e.error_index}: {last}"
        ) from None
    except mp.ProcessExitedException as e:
        raise CheckpointError(
            out, None, f"writing the resharded checkpoint failed: rank {e.error_index} exited ({e.exit_code})"
        ) from None


def write_rank(source: str, run_dir: str, raw: dict, tokenizer: str) -> None:
    """One rank of the new layout: build its engine, fill it from the source, save (collective)."""
    from megabam.checkpoint import rng, store
    from megabam.parallel.pipeline_layers import decoder_name, pipeline_layers
    from megabam.parallel.tensor_parallel import shard
    from megabam.parallel.topology import build_topology
    from megabam.train.engine import build_engine
    from megabam.train.optim import PLACEHOLDER

    cfg = config_from_dict(raw, SOURCE)
    reader = CheckpointReader(source)
    state = OptimizerState.read(reader)
    topology = build_topology(cfg.parallel.tensor, cfg.parallel.pipeline)
    # The weights come from the checkpoint: no initial folder to read.
    engine = build_engine(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=None)), topology)
    ds = engine.deepspeed
    tied = reader.model.lm_head is None
    new_layers = pipeline_layers(cfg.model.n_layers, tied) if topology.pp_size > 1 else None

    def local(name: str, full: torch.Tensor) -> torch.Tensor:
        split = reader.splits.get(name)
        if split is None or topology.tp_size == 1:
            return full
        return shard(full, split.dim, topology.tp_rank, topology.tp_size, split.parts)

    # ZeRO's AdamW steps one flat fp32 partition per group; its moments are created at the first step,
    # so they are created here, then every parameter's fragment of all three is written in place.
    adam = ds.optimizer.optimizer
    for group in adam.param_groups:
        (flat,) = group["params"]
        group.update({k: v for k, v in state.groups[group["name"]].hyper.items() if k in ("lr", "initial_lr")})
        adam.state[flat] = {"step": torch.tensor(float(state.step))}
        adam.state[flat].update({kind: torch.zeros_like(flat) for kind in KINDS[1:]})
    params = [(key, p) for key, p in ds.module.named_parameters() if not key.startswith(PLACEHOLDER)]
    # A placeholder stays zero, as in training. Progress in parameters of the full tensors read (what
    # the reading costs), rank 0's only (the ranks' shares are alike).
    total = sum(torch.Size(reader.shapes[decoder_name(key, new_layers)]).numel() for key, _ in params)
    report = Progress("reshard (rank 0)", total, " params", enabled=topology.rank == 0)

    def fill(name: str, param: torch.nn.Parameter) -> None:
        param.copy_(local(name, reader.tensor(name)))
        mapping = getattr(param, "_hp_mapping", None)  # None: no fragment in this rank's partition
        if not param.requires_grad or mapping is None:
            return
        flat = adam.param_groups[mapping.param_group_index]["params"][0]
        targets = {"fp32": flat, **{kind: adam.state[flat][kind] for kind in KINDS[1:]}}
        lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
        for kind, value in state.full(name).items():
            fragment = local(name, value).flatten().narrow(0, lp.start, lp.numel)
            targets[kind].narrow(0, hp.start, hp.numel).copy_(fragment)

    with torch.no_grad(), report:
        for key, param in params:
            name = decoder_name(key, new_layers)
            fill(name, param)
            report.advance(torch.Size(reader.shapes[name]).numel())
    names = [g["name"] for g in adam.param_groups]
    ds.lr_scheduler.load_state_dict(dict(state.scheduler_state(names), lr_lambdas=[None] * len(names)))
    ds.global_steps = state.counters["global_steps"]
    ds.global_samples = state.counters["global_samples"]
    ds.skipped_steps = state.counters["skipped_steps"]

    L = topology.layout
    old = ParallelLayout(state.dp, reader.tp, reader.pp)
    dp, pp, tp = L.coordinates(topology.rank)
    peer = old.rank(min(dp, old.data - 1), min(pp, old.pipeline - 1), min(tp, old.tensor - 1))
    rng.restore(json.loads((reader.path / f"rng_rank{peer:05d}.json").read_text()))
    meta = dataclasses.replace(reader.meta, config=raw, tokenizer=tokenizer)
    store.save(ds, Path(run_dir), meta, keep=1, shard=shard_identity(tp, L.tensor, L.pipeline))
