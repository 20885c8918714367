"""Megatron-style tensor parallelism, applied to a built `Decoder` by `apply_tp` (torchtitan style).

The model code has no parallel branches: each mixer and MLP declares how it splits (`tp_plan()`,
megabam/model/sharding.py), and `apply_tp` interprets those plans, swapping modules for parallel ones
and sharding the per-head parameters in place. Each rank keeps whole heads: attention q, k, v and its output
projection, each head's BAM θ_α, θ_β, θ_μ and SSMax s, the mLSTM and Gated DeltaNet projections,
gates, per-head norms and decay parameters. The SwiGLU hidden units, the embedding rows and the LM
head's vocabulary rows are split the same way. Norms and everything else stay replicated.

Initialisation: `apply_tp` slices a model that every rank has built in full from the same seed, so
a TP=k model from seed s holds exactly the shards of the TP=1 model from seed s. The price is the
full model's memory once at build time; models too large for one rank will need meta-device
construction with per-shard initialisation that reproduces the same values.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from megabam.model.sharding import TensorParallelPlan
from megabam.model.transformer import Decoder, VocabOutput
from megabam.parallel.mappings import (
    all_gather_along,
    copy_to_tensor_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
)
from megabam.parallel.topology import Topology


def shard(t: Tensor, dim: int, rank: int, size: int, parts: int | list[int] = 1) -> Tensor:
    """Rank `rank`'s share of `t` along `dim` when `t` is fused blocks along it: `parts` equal ones, or
    blocks of the sizes listed.

    Each block is split into `size` contiguous pieces and the rank takes its piece of every block: a
    fused [q | k | v] projection gives each rank the same heads of q, k and v (and, with fewer
    key/value heads, the kv heads its query heads use), and a fused [gate | up] (parts=2) the same
    hidden units of both halves.
    """
    sizes = [t.shape[dim] // parts] * parts if isinstance(parts, int) else parts
    if sum(sizes) != t.shape[dim] or any(n % size for n in sizes):
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split into blocks {sizes} of {size} pieces")
    return torch.cat([block.chunk(size, dim)[rank] for block in t.split(sizes, dim)], dim).detach().clone()


def unshard(pieces: list[Tensor], dim: int, parts: int | list[int] = 1) -> Tensor:
    """The full tensor from every rank's `shard` of it, in rank order: the inverse of `shard`."""
    size = len(pieces)
    if isinstance(parts, int):
        blocks = [piece.chunk(parts, dim) for piece in pieces]
    else:
        if any(n % size for n in parts):
            raise ValueError(f"blocks {parts} do not split into {size} pieces")
        blocks = [piece.split([n // size for n in parts], dim) for piece in pieces]
    return torch.cat([blocks[rank][b] for b in range(len(blocks[0])) for rank in range(size)], dim)


@dataclass(frozen=True)
class Split:
    """How tensor parallelism splits one tensor: along `dim`, fused blocks `parts` as in `shard`."""

    dim: int
    parts: int | tuple[int, ...] = 1


def tp_splits(model: Decoder) -> dict[str, Split]:
    """How `apply_tp` splits each tensor of the full model's state dict, by name (apply_tp keeps the
    names); a tensor not listed is replicated on every tensor rank. Read from the same plans apply_tp
    interprets, for checkpoint conversion; tests/unit/test_convert.py checks the two agree."""
    splits = {"embed.weight": Split(0)}
    if model.lm_head is not None:
        splits["lm_head.weight"] = Split(0)
    for i, block in enumerate(model.blocks):
        for part in ("mixer", "mlp"):
            module, prefix = getattr(block, part), f"blocks.{i}.{part}."
            plan = module.tp_plan()
            for name, parts in [*plan.column.items(), *plan.channels.items()]:
                split = Split(0, parts if isinstance(parts, int) else tuple(parts))
                for tensor_name, _ in getattr(module, name).named_parameters(recurse=False):  # weight, bias
                    splits[f"{prefix}{name}.{tensor_name}"] = split
            for name in plan.row:
                splits[f"{prefix}{name}.weight"] = Split(1)
            for name in plan.heads:
                target = getattr(module, name)
                if isinstance(target, nn.Module):
                    for tensor_name in target.state_dict(keep_vars=True):
                        if "." not in tensor_name:  # its own tensors, as apply_plan shards them
                            splits[f"{prefix}{name}.{tensor_name}"] = Split(0)
                elif target is not None:
                    splits[prefix + name] = Split(0)
    return splits


def sharded_parameter(t: Tensor, requires_grad: bool = True) -> nn.Parameter:
    """A parameter holding this rank's shard, marked `tensor_model_parallel` (Megatron's and DeepSpeed's
    mark): DeepSpeed's gradient norm counts marked parameters on every tensor rank and the others,
    replicated, on tensor rank 0 only."""
    p = nn.Parameter(t, requires_grad=requires_grad)
    p.tensor_model_parallel = True
    return p


class ColumnParallelLinear(nn.Module):
    """This rank's slice of the output features of x·Wᵀ + b, from a replicated input x.

    The input enters through copy_to_tensor_region: every rank's slice contributes to the gradient
    of x, and the backward all-reduce sums those contributions.
    """

    def __init__(self, weight: Tensor, bias, group):
        super().__init__()
        self.weight = sharded_parameter(weight)
        self.bias = None if bias is None else sharded_parameter(bias)
        self.group = group

    @classmethod
    def from_linear(cls, linear: nn.Linear, topology: Topology, parts: int | list[int] = 1) -> "ColumnParallelLinear":
        """Slice `linear`'s output rows (and bias), `parts` fused blocks kept aligned (see `shard`)."""
        r, k = topology.tp_rank, topology.tp_size
        bias = None if linear.bias is None else shard(linear.bias, 0, r, k, parts)
        return cls(shard(linear.weight, 0, r, k, parts), bias, topology.tp_group)

    def enter(self, x: Tensor) -> Tensor:
        """The input as this region sees it (under sequence parallelism the norm before the region has
        already gathered it, and this is the identity)."""
        return copy_to_tensor_region(x, self.group)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.enter(x), self.weight, self.bias)


class EnteredColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel linear whose input has already entered the region: through its mixer's shared
    `CopyToTensorRegion`, or under sequence parallelism through the norm's gather."""

    def enter(self, x: Tensor) -> Tensor:
        return x


class CopyToTensorRegion(nn.Module):
    """copy_to_tensor_region as a module: the single entry of a mixer whose projections all read the
    same input. One backward all-reduce of the summed input gradient instead of one per projection."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        return copy_to_tensor_region(x, self.group)


class RowParallelLinear(nn.Module):
    """x·Wᵀ from this rank's slice of the input features: partial products summed over the group."""

    def __init__(self, weight: Tensor, group):
        super().__init__()
        self.weight = sharded_parameter(weight)
        self.group = group

    @classmethod
    def from_linear(cls, linear: nn.Linear, topology: Topology) -> "RowParallelLinear":
        if linear.bias is not None:
            # A bias would have to be added once, after the sum; no row-parallel layer here has one.
            raise ValueError("RowParallelLinear takes linears without bias")
        return cls(shard(linear.weight, 1, topology.tp_rank, topology.tp_size), topology.tp_group)

    def leave(self, partial: Tensor) -> Tensor:
        """The sum of the ranks' partial outputs (sequence parallelism keeps one sequence shard of it)."""
        return reduce_from_tensor_region(partial, self.group)

    def forward(self, x: Tensor) -> Tensor:
        return self.leave(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    """The embedding rows vocab_start.. of this rank; ids outside them contribute zeros to the sum."""

    def __init__(self, weight: Tensor, vocab_start: int, group):
        super().__init__()
        self.weight = sharded_parameter(weight)
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return self.leave(x)

    def leave(self, partial: Tensor) -> Tensor:
        """The sum of the ranks' partial embeddings (sequence parallelism keeps one sequence shard of it)."""
        return reduce_from_tensor_region(partial, self.group)


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, vocab_start: int, group) -> Tensor:
    """Mean cross-entropy of `labels` (B, N) from vocabulary-sharded logits (B, N, V/TP), in fp32.

    Only per-row scalars cross ranks (the max, the sum of exponentials, the target's logit), never
    the logits. The loss is replicated on every rank, so each rank's backward through the identity
    backward of reduce_from_tensor_region gives its own shard softmax − one-hot: no communication.
    """
    logits = logits.float().flatten(0, 1)
    labels = labels.flatten()
    # Softmax does not change under a per-row shift; the global row max keeps exp() from overflowing
    # and, being a constant of the shift, carries no gradient.
    row_max = logits.detach().amax(-1)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max[:, None]
    sum_exp = reduce_from_tensor_region(shifted.exp().sum(-1), group)
    local = labels - vocab_start
    owned = (local >= 0) & (local < logits.shape[-1])
    target = shifted.gather(1, local.clamp(0, logits.shape[-1] - 1)[:, None]).squeeze(1)
    target = reduce_from_tensor_region(torch.where(owned, target, 0.0), group)
    return (sum_exp.log() - target).mean()


class VocabParallelOutput(VocabOutput):
    """The vocab-parallel `VocabOutput`: logits of this rank's vocabulary rows; the loss from them
    without gathering; full logits (gathered) only when no labels are given (evaluation, inference)."""

    def __init__(self, vocab_start: int, group, soft_cap: float | None):
        super().__init__(soft_cap)
        self.vocab_start = vocab_start
        self.group = group

    def enter(self, h: Tensor) -> Tensor:
        """The final hidden states as the head sees them (the identity under sequence parallelism, whose
        final norm gathers the sequence)."""
        return copy_to_tensor_region(h, self.group)

    def hidden_loss(self, h: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
        return self.loss(self.local_logits(h, weight), labels)  # the vocab-parallel loss, never gathered

    def full_logits(self, logits: Tensor) -> Tensor:
        return gather_from_tensor_region(logits, self.group)

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.vocab_start, self.group)

    def greedy(self, logits: Tensor) -> Tensor:
        """The argmax over the whole vocabulary without gathering the logits: each rank's best (value,
        token) per position crosses the group; ties go to the lowest token, as torch.argmax does."""
        best, token = logits.max(-1)
        # One collective: values and token ids travel as float64 (exact for both).
        pairs = all_gather_along(torch.stack([best.double(), (token + self.vocab_start).double()]), 0, self.group)
        values, tokens = pairs.view(-1, 2, *best.shape).unbind(1)
        winner = values.argmax(0)  # the first (lowest-vocabulary) rank among equal maxima
        return tokens.gather(0, winner[None]).squeeze(0).long()


def _shard_parameter(module: nn.Module, name: str, topology: Topology) -> None:
    """Replace a per-head parameter or buffer (head dimension first) by this rank's heads."""
    old = getattr(module, name)
    new = shard(old, 0, topology.tp_rank, topology.tp_size)
    # setattr on an existing buffer name keeps it a buffer, persistent or not.
    setattr(module, name, sharded_parameter(new, old.requires_grad) if isinstance(old, nn.Parameter) else new)


def _shard_depthwise_conv(conv: nn.Conv1d, topology: Topology, parts: int) -> nn.Conv1d:
    """The depthwise convolution of this rank's channels (one filter per channel, `parts` fused blocks)."""
    weight = shard(conv.weight, 0, topology.tp_rank, topology.tp_size, parts)
    local = nn.Conv1d(
        weight.shape[0], weight.shape[0], conv.kernel_size, groups=weight.shape[0], bias=False, device="meta"
    )
    local.weight = sharded_parameter(weight)
    return local


def apply_plan(module: nn.Module, plan: TensorParallelPlan, topology: Topology, sharded: set[int]) -> None:
    """Make `module` tensor-parallel as its plan says (megabam/model/sharding.py). `sharded` holds the
    ids of per-head submodules already split (one shared by several layers is split once)."""
    for what, heads in plan.head_counts.items():
        if heads % topology.tp_size:
            raise ValueError(f"{heads} {what} heads do not split over tensor-parallel size {topology.tp_size}")
    column = ColumnParallelLinear
    if plan.entry is not None:
        setattr(module, plan.entry, CopyToTensorRegion(topology.tp_group))
        column = EnteredColumnParallelLinear
    for name, parts in plan.column.items():
        setattr(module, name, column.from_linear(getattr(module, name), topology, parts))
    for name in plan.row:
        setattr(module, name, RowParallelLinear.from_linear(getattr(module, name), topology))
    for name, parts in plan.channels.items():
        setattr(module, name, _shard_depthwise_conv(getattr(module, name), topology, parts))
    for name in plan.heads:
        target = getattr(module, name)
        if isinstance(target, nn.Module):
            if id(target) in sharded:
                continue
            sharded.add(id(target))
            for tensor_name, _ in [*target.named_parameters(recurse=False), *target.named_buffers(recurse=False)]:
                _shard_parameter(target, tensor_name, topology)
        elif target is not None:
            _shard_parameter(module, name, topology)


def apply_tp(model: Decoder, topology: Topology) -> Decoder:
    """Convert `model`, built in full from the run's seed on every rank, to tensor-parallel in place.

    Every mixer and MLP is split by its own `tp_plan()`; the embedding, the LM head and the output
    by vocabulary rows. Afterwards each rank holds its shard of every split parameter; the forward
    with labels returns the same (replicated) loss as the full model, and without labels the full
    logits.
    """
    vocab = model.embed.weight.shape[0]
    if vocab % topology.tp_size:
        raise ValueError(f"vocabulary {vocab} does not split over tensor-parallel size {topology.tp_size}")
    r, k = topology.tp_rank, topology.tp_size
    vocab_start = r * (vocab // k)
    # With tied embeddings the output reads embed.weight, so replacing the embedding keeps them tied.
    model.embed = VocabParallelEmbedding(shard(model.embed.weight, 0, r, k), vocab_start, topology.tp_group)
    if model.lm_head is not None:  # only its weight is read (by the output)
        head = nn.Linear(model.lm_head.in_features, vocab // k, bias=False, device="meta")
        head.weight = sharded_parameter(shard(model.lm_head.weight, 0, r, k))
        model.lm_head = head
    model.output = VocabParallelOutput(vocab_start, topology.tp_group, model.output.soft_cap)
    sharded: set[int] = set()
    for block in model.blocks:
        for module in (block.mixer, block.mlp):
            if not hasattr(module, "tp_plan"):
                raise ValueError(f"{type(module).__name__} declares no tensor-parallel plan (tp_plan)")
            apply_plan(module, module.tp_plan(), topology, sharded)
    return model
