"""The tensor- and sequence-parallel collectives, each an autograd function whose backward is the dual.

Reading this file gives the whole contract between parallel layers:

| function                          | forward                          | backward                        |
|-----------------------------------|----------------------------------|---------------------------------|
| copy_to_tensor_region             | identity                         | all-reduce                      |
| reduce_from_tensor_region         | all-reduce                       | identity                        |
| scatter_to_tensor_region          | keep this rank's last-dim slice  | all-gather along the last dim   |
| gather_from_tensor_region         | all-gather along the last dim    | keep this rank's slice          |
| gather_from_sequence_region       | all-gather along the sequence    | reduce-scatter along it         |
| reduce_scatter_to_sequence_region | reduce-scatter along the sequence| all-gather along it             |

Activations are (batch, sequence, features), so the sequence dimension is 1. Every function takes
the process group explicitly (the tensor-parallel group of a `Topology`); nothing here holds state.
"""

import torch
import torch.distributed as dist
from torch import Tensor

SEQUENCE_DIM = 1


def _all_reduce(x: Tensor, group) -> Tensor:
    out = x.contiguous().clone()  # all_reduce works in place; never overwrite a tensor autograd saved
    dist.all_reduce(out, group=group)
    return out


def all_gather_along(x: Tensor, dim: int, group) -> Tensor:
    """Concatenation along `dim` of every rank's `x` (same shape on each), in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _local_slice(x: Tensor, dim: int, group) -> Tensor:
    """This rank's equal share of `x` along `dim`."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {size} ranks")
    return x.chunk(size, dim=dim)[rank].contiguous()


def _reduce_scatter(x: Tensor, dim: int, group) -> Tensor:
    """The sum over ranks of `x`, of which this rank keeps its share along `dim`.

    gloo implements neither reduce_scatter nor reduce_scatter_tensor, and the CPU runs (tests, the
    benchmark) use gloo, so this is an all-reduce followed by taking the local slice: the same result
    for twice the bytes of a true reduce-scatter. Sequence parallelism on NCCL should swap in
    dist.reduce_scatter_tensor here when it is turned on.
    """
    return _local_slice(_all_reduce(x, group), dim, group)


class _CopyToTensorRegion(torch.autograd.Function):
    """Enter a tensor-parallel region with a replicated input: each rank's gradient is partial."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    """Leave a tensor-parallel region: sum the ranks' partial outputs; the gradient is replicated."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _local_slice(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, -1, ctx.group), None


class _GatherFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _local_slice(grad, -1, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Sequence shards → the whole sequence (before a tensor-parallel region under sequence parallelism).
    The region's ranks each produce a partial gradient for the whole sequence: sum it, keep the shard."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQUENCE_DIM, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Partial outputs of a tensor-parallel region → their sum, one sequence shard per rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, SEQUENCE_DIM, ctx.group), None


def copy_to_tensor_region(x: Tensor, group) -> Tensor:
    return _CopyToTensorRegion.apply(x, group)


def reduce_from_tensor_region(x: Tensor, group) -> Tensor:
    return _ReduceFromTensorRegion.apply(x, group)


def scatter_to_tensor_region(x: Tensor, group) -> Tensor:
    return _ScatterToTensorRegion.apply(x, group)


def gather_from_tensor_region(x: Tensor, group) -> Tensor:
    return _GatherFromTensorRegion.apply(x, group)


def gather_from_sequence_region(x: Tensor, group) -> Tensor:
    return _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_region(x: Tensor, group) -> Tensor:
    return _ReduceScatterToSequenceRegion.apply(x, group)
