"""Pipeline parallelism: a built `Decoder` cut into the stages of DeepSpeed's pipeline engine.

Like tensor parallelism (torchtitan style), this is applied after construction: every rank builds
the whole model from the run's seed (tensor-parallel shards already taken), then `build_pipeline`
hands its modules to a DeepSpeed `PipelineModule`, which keeps the layers of this rank's stage. So a
PP=k model from seed s holds exactly the layers of the PP=1 model from seed s.

The layer list is [embedding, block 0, …, block L−1, final norm, head] (megabam/parallel/
pipeline_layers.py, which checkpoint conversion reads too). Between stages flows the
tuple (hidden states, document ids); the SWA window of the step, the same for every micro-batch and
rank, is read from a `StepContext` the trainer sets before each batch. With tied embeddings the
first and last stage each hold the embedding (one `TiedLayerSpec` key): DeepSpeed broadcasts it
from the first stage at start-up and all-reduces its gradient between the two, so the copies stay
equal. The last stage returns this rank's logits (a vocabulary shard under TP) and DeepSpeed calls
the model's own `loss` on them, so the vocab-parallel loss never gathers the logits.

DeepSpeed's grid is built from the project `Topology` with the same rank order (axes data, pipe,
model: tensor fastest) and checked against it, so the two agree on every rank's coordinates.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import ProcessTopology
from torch import Tensor, nn

from megabam.model.layers import SequenceInfo
from megabam.model.transformer import Block, Decoder, VocabOutput
from megabam.parallel.pipeline_layers import EMBEDDING_KEY, TIED_HEAD, pipeline_layers
from megabam.parallel.topology import Topology


@dataclass
class StepContext:
    """What every stage needs per step but is not an activation: the SWA window (None = the
    configured one)."""

    window: int | None = None


class EmbeddingStage(nn.Module):
    """(token ids, document ids) → (embeddings, document ids), positions added where the model uses them."""

    def __init__(self, embed: nn.Module, positions: nn.Module | None):
        super().__init__()
        self.embed = embed
        self.positions = positions

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        ids, doc_ids = inputs
        x = self.embed(ids)
        return (x if self.positions is None else self.positions(x)), doc_ids


class BlockStage(nn.Module):
    """One decoder block on the (hidden states, document ids) tuple; `index` is its layer in the model."""

    def __init__(self, block: Block, index: int, context: StepContext):
        super().__init__()
        self.block = block
        self.index = index
        self.context = context

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, doc_ids = inputs
        return self.block(x, SequenceInfo(doc_ids=doc_ids, window=self.context.window)), doc_ids


class FinalNormStage(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        return self.norm(inputs[0])


class HeadStage(nn.Module):
    """This rank's logits from an untied LM head."""

    def __init__(self, lm_head: nn.Linear, output: VocabOutput):
        super().__init__()
        self.lm_head = lm_head
        self.output = output

    def forward(self, h: Tensor) -> Tensor:
        return self.output.local_logits(h, self.lm_head.weight)


def _tied_head(output: VocabOutput, embedding: EmbeddingStage, h: Tensor) -> Tensor:
    """The last stage's use of the tied embedding: this rank's logits h·Eᵀ."""
    return output.local_logits(h, embedding.embed.weight)


class DecoderPipeline(PipelineModule):
    """DeepSpeed's PipelineModule with stage boundaries that may be given explicitly."""

    def __init__(self, layers: list, boundaries: list[int], **kwargs):
        # Read by _partition_layers, which PipelineModule.__init__ calls.
        self.explicit_parts = [0, *(b + 1 for b in boundaries), len(layers)] if boundaries else None
        super().__init__(layers, **kwargs)

    def _partition_layers(self, method: str = "parameters") -> None:
        if self.explicit_parts is None:
            return super()._partition_layers(method)
        self.parts = self.explicit_parts
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    def local_blocks(self) -> list[tuple[int, Block]]:
        """(layer index in the model, block) of the blocks on this stage."""
        return [(f.index, f.block) for f in self.forward_funcs if isinstance(f, BlockStage)]


def deepspeed_topology(topology: Topology) -> ProcessTopology:
    """The project's layout as DeepSpeed's ProcessTopology: axes outermost first, so the rank order
    ((dp · PP) + pp) · TP + tp is the same."""
    L = topology.layout
    return ProcessTopology(axes=["data", "pipe", "model"], dims=[L.data, L.pipeline, L.tensor])


def build_pipeline(model: Decoder, topology: Topology, boundaries: list[int], context: StepContext) -> DecoderPipeline:
    """This rank's stage of `model` (already tensor-parallel if TP > 1) as a DeepSpeed pipeline module."""
    positions = model.positions if model.sinusoidal else None
    stages = {f"blocks.{i}": BlockStage(block, i, context) for i, block in enumerate(model.blocks)}
    tied = model.lm_head is None
    if tied:
        first = TiedLayerSpec(EMBEDDING_KEY, EmbeddingStage, model.embed, positions, tied_weight_attr="embed.weight")
        last = TiedLayerSpec(
            EMBEDDING_KEY,
            EmbeddingStage,
            model.embed,
            positions,
            tied_weight_attr="embed.weight",
            forward_fn=partial(_tied_head, model.output),
        )
    else:
        first, last = EmbeddingStage(model.embed, positions), HeadStage(model.lm_head, model.output)
    stages.update({"embed": first, "norm": FinalNormStage(model.norm), TIED_HEAD if tied else "lm_head": last})
    layers = [stages[name] for name in pipeline_layers(len(model.blocks), tied)]
    # no_grad: DeepSpeed broadcasts the tied embedding in place at construction, which autograd
    # would otherwise record on the parameter.
    with torch.no_grad():
        pipeline = DecoderPipeline(
            layers,
            boundaries,
            topology=deepspeed_topology(topology),
            loss_fn=model.output.loss,
            partition_method="parameters",
        )
    grid = pipeline.mpu()
    mine = (grid.get_data_parallel_rank(), grid.get_pipe_parallel_rank(), grid.get_slice_parallel_rank())
    if mine != (topology.dp_rank, topology.pp_rank, topology.tp_rank):
        raise RuntimeError(
            f"DeepSpeed's pipeline grid places rank {topology.rank} at (dp, pp, tp) = {mine}, "
            f"the topology at {(topology.dp_rank, topology.pp_rank, topology.tp_rank)}"
        )
    _release_other_stages(model, pipeline)
    return pipeline


def pipeline_greedy(
    pipeline: DecoderPipeline,
    topology: Topology,
    output: VocabOutput,
    context: StepContext,
    width: int,
    sequence_parallel: bool,
):
    """`predict(ids)` (the most likely next token at each position) through the stages, for evaluation
    outside DeepSpeed's engine (any length, no micro-batches). Collective over the pipeline group.

    Each stage runs its layers on the hidden states the previous one sends (point to point, same data
    and tensor rank); the last takes the argmax from its logits (over the tensor group without
    gathering them) and broadcasts the ids to the other stages. The states passed between stages are
    (B, N, width) in the model's dtype; under sequence parallelism each rank passes its N/TP shard.
    """
    L = topology.layout
    shard = topology.tp_size if sequence_parallel else 1
    last = topology.pp_size - 1

    def peer(stage: int) -> int:
        return L.rank(topology.dp_rank, stage, topology.tp_rank)

    @torch.no_grad()
    def predict(ids: Tensor) -> Tensor:
        context.window = None
        doc_ids = torch.zeros_like(ids)
        x = (ids, doc_ids)
        if topology.pp_rank > 0:
            dtype = next(pipeline.parameters()).dtype  # DeepSpeed casts the module for bf16 training
            states = torch.empty(ids.shape[0], ids.shape[1] // shard, width, dtype=dtype, device=ids.device)
            dist.recv(states, src=peer(topology.pp_rank - 1))
            x = (states, doc_ids)
        out = pipeline(x)
        if topology.pp_rank < last:
            dist.send(out[0].contiguous(), dst=peer(topology.pp_rank + 1))
            predicted = torch.empty_like(ids)
        else:
            predicted = output.greedy(out)
        dist.broadcast(predicted, src=peer(last), group=topology.pp_group)
        return predicted

    return predict


def _release_other_stages(model: Decoder, pipeline: nn.Module) -> None:
    """Move the layers of other stages to the meta device. DeepSpeed keeps the layer list it was
    given, so without this every rank would hold the whole model for the whole run."""
    local = {id(p) for p in pipeline.parameters()}
    for module in [model.embed, *model.blocks, model.norm, model.lm_head]:
        if module is not None and not any(id(p) in local for p in module.parameters()):
            module.to("meta")
