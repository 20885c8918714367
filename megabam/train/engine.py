"""Process-group start-up and the DeepSpeed engine around the model."""
import os
import socket
from dataclasses import dataclass
from typing import Callable, Optional

import deepspeed
import torch
import torch.distributed as dist

from megabam.config.loader import ConfigError
from megabam.config.schema import Config
from megabam.data.layout import ParallelLayout
from megabam.model import Decoder
from megabam.parallel.activation_checkpoint import apply_ac
from megabam.parallel.deepspeed_mpu import DeepSpeedMpu
from megabam.parallel.pipeline import StepContext, build_pipeline, pipeline_greedy
from megabam.parallel.sequence_parallel import apply_sp
from megabam.parallel.tensor_parallel import apply_tp
from megabam.parallel.topology import Topology
from megabam.train.optim import build_optimizer, build_scheduler


def init_distributed() -> None:
    """Join the process group that torchrun / the deepspeed launcher describe in the environment.

    A plain `megabam train` is given a one-rank world on loopback, so the same DeepSpeed path runs
    with one process as with many. All five variables are set together: DeepSpeed falls back to MPI
    discovery (and replaces MASTER_ADDR) when any is missing.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])  # streaming reads it
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_config(cfg: Config) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.train.grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
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


@dataclass
class TrainingModel:
    """The DeepSpeed engine and what the trainer needs to know about the model it wraps.

    `pipeline` is None without pipeline parallelism (the engine is called per micro-batch), else the
    step context the pipeline stages read (the engine runs a whole step in `train_batch`). Size and
    FLOPs are the whole model's, taken before it was split over ranks.
    """

    engine: object
    params: int
    flops_per_token: float
    pipeline: Optional[StepContext]
    predict: Callable[[torch.Tensor], torch.Tensor]  # token ids → most likely next tokens (passkey_accuracy)

    def local_blocks(self) -> list:
        """(layer index, block) of the decoder blocks this rank holds."""
        module = self.engine.module
        return module.local_blocks() if self.pipeline is not None else list(enumerate(module.blocks))


def build_topology(cfg: Config) -> Topology:
    """The layout of this launch: tensor and pipeline sizes from the config, data parallelism from the
    rest of the world."""
    world, model_parallel = dist.get_world_size(), cfg.parallel.tensor * cfg.parallel.pipeline
    if world % model_parallel:
        raise ConfigError("<launch>", "parallel.tensor", f"world size {world} is not a multiple of "
                          f"parallel.tensor · parallel.pipeline = {model_parallel}")
    return Topology(ParallelLayout(data=world // model_parallel, tensor=cfg.parallel.tensor,
                                   pipeline=cfg.parallel.pipeline))


def build_engine(cfg: Config, topology: Topology) -> TrainingModel:
    """Model (seeded; then tensor-parallel, sequence-parallel and split into pipeline stages as the
    topology and config say), AdamW groups and schedule, wrapped by `deepspeed.initialize` with ZeRO
    over the data-parallel group."""
    torch.manual_seed(cfg.run.seed)
    model = Decoder(cfg.model)
    params, flops_per_token = model.num_params(), model.flops_per_token(cfg.data.seq_len)
    if topology.tp_size > 1:
        # Every rank built the whole model from the seed; each keeps its shards, so TP=k holds exactly
        # the shards of the TP=1 model.
        apply_tp(model, topology)
        if cfg.parallel.sequence_parallel:
            apply_sp(model, topology)
    apply_ac(model, cfg.parallel.recompute, cfg.parallel.recompute_mixers)
    context, mpu, predict = None, DeepSpeedMpu(topology), model.greedy
    if topology.pp_size > 1:
        # The pipeline module brings DeepSpeed's grid (built from the same topology) as its mpu.
        context, mpu, output = StepContext(), None, model.output
        model = build_pipeline(model, topology, cfg.parallel.pipeline_boundaries, context)
        predict = pipeline_greedy(model, topology, output, context, cfg.model.d_model, cfg.parallel.sequence_parallel)
    optimizer = build_optimizer(model, cfg.optim)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        mpu=mpu,
        # A callable, so the schedule wraps the optimizer DeepSpeed actually steps (ZeRO wraps ours).
        lr_scheduler=lambda opt: build_scheduler(opt, cfg.schedule, cfg.train.steps),
        config=deepspeed_config(cfg),
    )
    return TrainingModel(engine, params, flops_per_token, context, predict)
