"""Megatron-style sequence parallelism on top of tensor parallelism, applied by `apply_sp` after `apply_tp`.

Between tensor-parallel regions (the norms and residual adds) each TP rank holds one shard of the
sequence, (B, N/TP, d), instead of the whole replicated sequence: activation memory there drops by
TP. The swaps, each a subclass that changes only how a module enters or leaves its region:

- every region (mixer, SwiGLU, output head) starts after a norm: the norm runs on the shard, then
  all-gathers the sequence (backward: reduce-scatter, which sums the ranks' partial input gradients),
  so the column-parallel linears and the head take their input as it comes, without the
  copy_to_tensor_region of plain TP (a recurrent mixer's shared entry becomes the identity). One
  gather per region, and `stream` passes through the same norms as `forward`;
- every row-parallel linear reduce-scatters its partial outputs along the sequence instead of
  all-reducing them;
- the vocab-parallel embedding reduce-scatters its partial embeddings into shards, and the
  sinusoidal positions added after it are those of the shard;
- the norms' weights, replicated over TP but fed one shard each, all-reduce their gradient.

Mixers see the whole gathered sequence, so documents (doc_ids), SSMax lengths, RoPE and the BAM
prior's distances are unchanged. The projections still save the gathered normed input for their
backward; Megatron saves the shard and gathers it again in the backward, which this does not do yet.

Sequence lengths must split over the TP ranks, in training and in evaluation. `Decoder.stream`
works on chunks whose length splits too; token-by-token generation needs the model without
sequence parallelism, which holds the same parameters (an SP checkpoint loads into a TP model).
"""

import torch.distributed as dist
from torch import Tensor, nn

from megabam.model.layers import RMSNorm, rms_norm
from megabam.model.positional import SinusoidalPositions
from megabam.model.transformer import Decoder
from megabam.parallel.mappings import (
    copy_to_tensor_region,
    gather_from_sequence_region,
    reduce_scatter_to_sequence_region,
)
from megabam.parallel.tensor_parallel import (
    ColumnParallelLinear,
    CopyToTensorRegion,
    EnteredColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelOutput,
)
from megabam.parallel.topology import Topology


class SequenceParallelRowLinear(RowParallelLinear):
    def leave(self, partial: Tensor) -> Tensor:
        return reduce_scatter_to_sequence_region(partial, self.group)


class SequenceParallelEmbedding(VocabParallelEmbedding):
    def leave(self, partial: Tensor) -> Tensor:
        return reduce_scatter_to_sequence_region(partial, self.group)


class SequenceParallelOutput(VocabParallelOutput):
    """Its input is already the whole sequence, gathered by the final norm."""

    def enter(self, h: Tensor) -> Tensor:
        return h


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm of a sequence shard, then the whole normed sequence for the region after it.

    The weight, replicated over TP, gets only this shard's part of the gradient locally. It enters
    through copy_to_tensor_region, identity forward and all-reduce backward, so the all-reduce is part
    of the autograd graph: every rank's .grad is the whole sequence's gradient before any hook,
    optimizer or ZeRO sees it, under activation recomputation too, with no bookkeeping of which
    parameters need it. The price is one small all-reduce (d values) per norm
    per backward, instead of Megatron's one bucketed all-reduce after the backward.
    """

    def __init__(self, norm: RMSNorm, group):
        super().__init__(norm.weight.shape[0], norm.eps, norm.backend)
        self.weight = norm.weight
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        y = rms_norm(x, copy_to_tensor_region(self.weight, self.group), self.eps, self.backend)
        return gather_from_sequence_region(y, self.group)


class ShardedSinusoidalPositions(SinusoidalPositions):
    """The positions of this rank's shard: it starts TP-rank shards into the sequence."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        return super().forward(x, start + dist.get_rank(self.group) * x.shape[1])


def _swap(module: nn.Module, g) -> nn.Module:
    """The sequence-parallel version of a TP module of a region, holding the same parameter tensors:
    the norm before the region has gathered its input, so nothing else enters it."""
    if isinstance(module, CopyToTensorRegion):
        return nn.Identity()
    if isinstance(module, ColumnParallelLinear):
        return EnteredColumnParallelLinear(module.weight.data, None if module.bias is None else module.bias.data, g)
    if isinstance(module, RowParallelLinear):
        return SequenceParallelRowLinear(module.weight.data, g)
    return module


def apply_sp(model: Decoder, topology: Topology) -> Decoder:
    """Convert a model `apply_tp` made tensor-parallel to sequence-parallel in place.

    Parameters are neither added nor resharded: the swapped modules take over the same tensors, so
    parameter names, shapes and values are those of the TP model.
    """
    g = topology.tp_group
    model.embed = SequenceParallelEmbedding(model.embed.weight.data, model.embed.vocab_start, g)
    model.positions = ShardedSinusoidalPositions(g)
    model.output = SequenceParallelOutput(model.output.vocab_start, g, model.output.soft_cap)
    model.norm = SequenceParallelRMSNorm(model.norm, g)
    for block in model.blocks:
        # Only the norms between regions see shards; norms inside mixers see the gathered sequence.
        block.mixer_norm = SequenceParallelRMSNorm(block.mixer_norm, g)
        block.mlp_norm = SequenceParallelRMSNorm(block.mlp_norm, g)
        for parent in [block.mixer, block.mlp]:
            for name, child in list(parent.named_children()):
                setattr(parent, name, _swap(child, g))
    return model
