"""The one place where a built model becomes this rank's parallel model, in the only order that works:
tensor parallelism (shards of every split parameter), then sequence parallelism (swaps the TP
regions' entries and exits, so it needs them), then torch.compile of each block (compiles the modules
TP and SP left in place), then activation recomputation (wraps those forwards, compiled or not: a
recomputed region cannot be traced across the kernels' calls, compile.py), then the pipeline cut
(hands the finished blocks to DeepSpeed's pipeline module and frees the other stages' layers)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from megabam.config.schema import Config
from megabam.model import Decoder
from megabam.parallel.activation_checkpoint import apply_ac
from megabam.parallel.compile import apply_compile
from megabam.parallel.deepspeed_mpu import DeepSpeedMpu
from megabam.parallel.pipeline import StepContext, build_pipeline, pipeline_greedy
from megabam.parallel.sequence_parallel import apply_sp
from megabam.parallel.tensor_parallel import apply_tp
from megabam.parallel.topology import Topology


@dataclass
class ParallelModel:
    """What DeepSpeed wraps and how the trainer drives it.

    `module` is the decoder, or this rank's pipeline stage; `step_context` is None without pipeline
    parallelism (the engine is called per micro-batch), else what every stage reads per step (the
    engine runs a whole step in `train_batch`); `mpu` is DeepSpeed's view of the topology (None with
    a pipeline, whose module brings DeepSpeed's own grid); `predict` maps token ids to the most
    likely next tokens, through every stage.
    """

    module: nn.Module
    step_context: StepContext | None
    mpu: DeepSpeedMpu | None
    predict: Callable[[torch.Tensor], torch.Tensor]


def parallelize(model: Decoder, cfg: Config, topology: Topology) -> ParallelModel:
    """`model`, built in full from the run's seed on every rank, as this rank's part of the layout."""
    if topology.tp_size > 1:
        # Every rank built the whole model from the seed; each keeps its shards, so TP=k holds exactly
        # the shards of the TP=1 model.
        apply_tp(model, topology)
        if cfg.parallel.sequence_parallel:
            apply_sp(model, topology)
    apply_compile(model, cfg.train.compile)
    apply_ac(model, cfg.parallel.recompute, cfg.parallel.recompute_mixers)
    if topology.pp_size == 1:
        return ParallelModel(model, None, DeepSpeedMpu(topology), model.greedy)
    context, output = StepContext(), model.output
    stage = build_pipeline(model, topology, cfg.parallel.pipeline_boundaries, context)
    predict = pipeline_greedy(stage, topology, output, context, cfg.model.d_model, cfg.parallel.sequence_parallel)
    return ParallelModel(stage, context, None, predict)
