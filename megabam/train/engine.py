"""The DeepSpeed engine around this rank's parallel model, and how one step runs on it."""

import importlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from megabam.checkpoint.shards import record_layer_identity
from megabam.config.schema import Config
from megabam.model import Decoder
from megabam.parallel.distributed import rank_device
from megabam.parallel.parallelize import ParallelModel, parallelize
from megabam.parallel.topology import Topology
from megabam.plan.counts import training_flops_per_token
from megabam.plan.memory import DEEPSPEED_BUCKET
from megabam.train.logger import head_parameters
from megabam.train.optim import add_group_placeholders, build_optimizer, build_scheduler, group_of


def deepspeed_config(cfg: Config, rank_params: int) -> dict:
    """DeepSpeed's config for `cfg`; ZeRO's buckets hold at most the rank's `rank_params` parameters
    (DeepSpeed allocates its 5e8-element reduce bucket whatever the model's size: 1.9 GB in fp32)."""
    bucket = max(1, min(DEEPSPEED_BUCKET, rank_params))
    config = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.train.grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {
            "stage": cfg.parallel.zero_stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        },
        # check_grad_overflow: skip (on every rank) an update whose gradient norm is not finite.
        "bf16": {"enabled": cfg.train.precision == "bf16", "check_grad_overflow": True},
        # megabam's AdamW groups carry per-group lr multipliers; ZeRO shards any torch optimizer.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if cfg.parallel.pipeline > 1 and cfg.parallel.sequence_parallel:
        # DeepSpeed splits an activation sent between stages over the tensor group and gathers it on
        # arrival, assuming every tensor rank holds the same activation; under sequence parallelism
        # each holds its own sequence shard (already 1/TP of the data), so it is sent whole.
        config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    return config


def _pipeline_batch(batch: dict) -> tuple:
    """A micro-batch as DeepSpeed's pipeline engine takes it: (first stage's inputs, last stage's labels)."""
    return (batch["input_ids"], batch["doc_ids"]), batch["labels"]


@dataclass
class TrainingEngine:
    """The DeepSpeed engine (`deepspeed`) and the parallel model it wraps (`parallel`). Size and FLOPs
    are the whole model's, taken before it was split over ranks."""

    deepspeed: deepspeed.DeepSpeedEngine
    parallel: ParallelModel
    topology: Topology
    device: torch.device  # where batches go: this rank's GPU, or the CPU
    params: int
    flops_per_token: float

    def step(self, micro_batches: list[dict], window: int | None) -> torch.Tensor:
        """One optimizer step over the micro-batches; returns their losses summed (float64). Under
        pipeline parallelism the engine returns the mean over the micro-batches and data-parallel ranks
        on every rank, so the sum is that mean times the number of micro-batches."""
        engine, context = self.deepspeed, self.parallel.step_context
        if context is not None:
            context.window = window
            loss = engine.train_batch(iter([_pipeline_batch(b) for b in micro_batches]))
            return loss.detach().double() * len(micro_batches)
        loss_sum = torch.zeros((), device=micro_batches[0]["input_ids"].device, dtype=torch.float64)
        for batch in micro_batches:
            loss = engine(batch["input_ids"], batch["labels"], batch["doc_ids"], window)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().double()
        return loss_sum

    @torch.no_grad()
    def mean_loss(self, batches: list[dict]) -> float:
        """Mean loss over `batches` (the configured SWA window), averaged over data-parallel ranks."""
        engine, context, device = self.deepspeed, self.parallel.step_context, self.device
        if context is not None:
            # Every stage must run the same number of micro-batches: the fewest any rank has.
            count = torch.tensor([len(batches)], device=device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            batches = batches[: int(count)]
            if not batches:
                return math.nan
            context.window = None
            loss = engine.eval_batch(iter([_pipeline_batch(b) for b in batches]), num_micro_batches=len(batches))
            return float(loss)
        engine.eval()
        total = torch.zeros(2, device=device)
        for batch in batches:
            total[0] += engine(batch["input_ids"], batch["labels"], batch["doc_ids"]).float()
            total[1] += 1
        engine.train()
        dist.all_reduce(total)
        return (total[0] / total[1]).item() if total[1] > 0 else math.nan

    def predict(self, ids: torch.Tensor) -> torch.Tensor:
        """The most likely next token at each position (passkey scoring), through every stage."""
        return self.parallel.predict(ids)

    def current_lr(self) -> float:
        """The peak-relative learning rate the next step will use (group lr divided by its multiplier)."""
        group = self.deepspeed.optimizer.param_groups[0]
        return group["lr"] / group["lr_mult"]

    def head_parameters(self) -> dict[str, float]:
        """Per-head prior and SSMax values of every layer (collective over the pipeline group; each stage
        knows its own layers). Under TP, this tensor rank's heads."""
        module = self.deepspeed.module
        blocks = module.local_blocks() if self.parallel.step_context is not None else list(enumerate(module.blocks))
        mine = head_parameters(blocks)
        if self.topology.pp_size == 1:
            return mine
        stages: list = [None] * self.topology.pp_size
        dist.all_gather_object(stages, mine, group=self.topology.pp_group)
        return {key: value for stage in stages for key, value in stage.items()}


def import_muon_uncompiled() -> None:
    """DeepSpeed's ZeRO optimizer check (deepspeed.initialize) imports its Muon module, whose
    module-level torch.compile loads inductor: ~0.8 s of every start (docs/benchmarks.md, "Test
    suite"), for an optimizer megabam does not use. Imported first here with dynamo disabled for that
    import alone, torch.compile hands Muon's functions back as they are; the environment is restored
    at once, so train.compile, FlexAttention's compile (kernels/dispatch.py) and a user's are
    untouched, in this process and those it starts. A TORCHDYNAMO_DISABLE the user set is theirs."""
    if "TORCHDYNAMO_DISABLE" in os.environ:
        return
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")
    finally:
        del os.environ["TORCHDYNAMO_DISABLE"]


def build_engine(cfg: Config, topology: Topology) -> TrainingEngine:
    """Model (seeded; then made this rank's part of the layout by `parallelize`), AdamW groups and
    schedule, wrapped by `deepspeed.initialize` with ZeRO over the data-parallel group."""
    torch.manual_seed(cfg.run.seed)
    model = Decoder(cfg.model)
    if cfg.train.init_from:  # a resumed run loads its own checkpoint over these afterwards
        from megabam.checkpoint.consolidated import load_initial_weights

        load_initial_weights(model, cfg.model, Path(cfg.train.init_from))
    # MFU's numerator: the planner's model FLOPs (megabam/plan/counts.py), one formula for both
    params, flops_per_token = model.num_params(), training_flops_per_token(cfg, model)["model"]
    groups = {group_of(name, p) for name, p in model.named_parameters() if p.requires_grad}
    parallel = parallelize(model, cfg, topology)
    if topology.pp_size > 1:
        add_group_placeholders(parallel.module, groups)  # every stage must step the same parameter groups
        record_layer_identity(parallel.module, topology.tp_rank, topology.tp_size, topology.pp_size)
    import_muon_uncompiled()
    engine, _, _, _ = deepspeed.initialize(
        model=parallel.module,
        optimizer=build_optimizer(parallel.module, cfg.optim),
        mpu=parallel.mpu,
        # A callable, so the schedule wraps the optimizer DeepSpeed actually steps (ZeRO wraps ours).
        lr_scheduler=lambda opt: build_scheduler(opt, cfg.schedule, cfg.train.steps),
        config=deepspeed_config(cfg, sum(p.numel() for p in parallel.module.parameters())),
    )
    return TrainingEngine(engine, parallel, topology, rank_device(), params, flops_per_token)


def tracked_step(engine: TrainingEngine, micro_batches: list[dict], window: int | None) -> tuple[torch.Tensor, int]:
    """engine.step with every tensor allocation counted (CPU has no allocator statistics): the loss
    sum and the peak bytes of live tensors during the step, the weights, gradients and optimizer state
    that exist before it included."""
    from megabam.train.live_tensors import LiveTensors

    optimizer = engine.deepspeed.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps torch's AdamW
    existing = [*engine.deepspeed.module.parameters(), *(p for g in inner.param_groups for p in g["params"])]
    existing += [t for state in inner.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    existing += [p.grad for p in existing if p.grad is not None]
    with LiveTensors(existing) as live:
        loss_sum = engine.step(micro_batches, window)
    return loss_sum, live.peak
