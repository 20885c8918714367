"""Megatron-style tensor parallelism, applied to a built `Decoder` by `apply_tp` (torchtitan style).

The model code has no parallel branches: `apply_tp` swaps its modules for parallel ones and shards
the per-head parameters in place. Each rank keeps whole heads: attention q, k, v and its output
projection, each head's BAM θ_α, θ_β, θ_μ and SSMax s, the mLSTM and Gated DeltaNet projections,
gates, per-head norms and decay parameters. The SwiGLU hidden units, the embedding rows and the LM
head's vocabulary rows are split the same way. Norms and everything else stay replicated.

Initialisation: `apply_tp` slices a model that every rank has built in full from the same seed, so
a TP=k model from seed s holds exactly the shards of the TP=1 model from seed s. The price is the
full model's memory once at build time; models too large for one rank will need meta-device
construction with per-shard initialisation that reproduces the same values.
"""
from typing import Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from megabam.model.attention import Attention
from megabam.model.gated_deltanet import GatedDeltaNet
from megabam.model.layers import SwiGLU
from megabam.model.mlstm import MLstm
from megabam.model.transformer import Decoder, VocabOutput
from megabam.parallel.mappings import (all_gather_along, copy_to_tensor_region, gather_from_tensor_region,
                                       reduce_from_tensor_region)
from megabam.parallel.topology import Topology


def shard(t: Tensor, dim: int, rank: int, size: int, parts: Union[int, list[int]] = 1) -> Tensor:
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
    def from_linear(cls, linear: nn.Linear, topology: Topology, parts: Union[int, list[int]] = 1) -> "ColumnParallelLinear":
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

    def __init__(self, vocab_start: int, group):
        super().__init__()
        self.vocab_start = vocab_start
        self.group = group

    def enter(self, h: Tensor) -> Tensor:
        """The final hidden states as the head sees them (the identity under sequence parallelism, whose
        final norm gathers the sequence)."""
        return copy_to_tensor_region(h, self.group)

    def local_logits(self, h: Tensor, weight: Tensor) -> Tensor:
        return F.linear(self.enter(h), weight)

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


def _local_heads(heads: int, topology: Topology, what: str) -> int:
    if heads % topology.tp_size:
        raise ValueError(f"{heads} {what} heads do not split over tensor-parallel size {topology.tp_size}")
    return heads // topology.tp_size


def _shard_attention(attn: Attention, topology: Topology, sharded: set[int]) -> None:
    q_rows, kv_rows = attn.n_heads * attn.head_dim, attn.kv_heads * attn.head_dim
    attn.n_heads = _local_heads(attn.n_heads, topology, "attention")
    attn.kv_heads = _local_heads(attn.kv_heads, topology, "attention key/value")
    attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, topology, parts=[q_rows, kv_rows, kv_rows])
    attn.out = RowParallelLinear.from_linear(attn.out, topology)
    if attn.ssmax_s is not None:
        _shard_parameter(attn, "ssmax_s", topology)
    # A prior shared across layers is one module: shard it once.
    if attn.prior is not None and id(attn.prior) not in sharded:
        sharded.add(id(attn.prior))
        for name, _ in [*attn.prior.named_parameters(recurse=False), *attn.prior.named_buffers(recurse=False)]:
            _shard_parameter(attn.prior, name, topology)


def _shard_mlstm(cell: MLstm, topology: Topology, sharded: set[int]) -> None:
    cell.n_heads = _local_heads(cell.n_heads, topology, "mLSTM")
    cell.enter = CopyToTensorRegion(topology.tp_group)
    for name in ("q", "k", "v", "igate", "fgate", "ogate"):
        setattr(cell, name, EnteredColumnParallelLinear.from_linear(getattr(cell, name), topology))
    _shard_parameter(cell, "norm_weight", topology)
    cell.out = RowParallelLinear.from_linear(cell.out, topology)


def _shard_gated_deltanet(cell: GatedDeltaNet, topology: Topology, sharded: set[int]) -> None:
    cell.n_heads = _local_heads(cell.n_heads, topology, "Gated DeltaNet")
    cell.enter = CopyToTensorRegion(topology.tp_group)
    cell.qkv = EnteredColumnParallelLinear.from_linear(cell.qkv, topology, parts=3)
    # The depthwise convolution has one filter per [q | k | v] channel: keep those of the local heads.
    conv = cell.conv
    conv.weight = sharded_parameter(shard(conv.weight, 0, topology.tp_rank, topology.tp_size, parts=3))
    conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]
    for name in ("a", "b", "gate"):
        setattr(cell, name, EnteredColumnParallelLinear.from_linear(getattr(cell, name), topology))
    for name in ("A_log", "dt_bias", "norm_weight"):
        _shard_parameter(cell, name, topology)
    cell.out = RowParallelLinear.from_linear(cell.out, topology)


_MIXER_PLANS = {Attention: _shard_attention, MLstm: _shard_mlstm, GatedDeltaNet: _shard_gated_deltanet}


def _shard_mlp(mlp: SwiGLU, topology: Topology) -> None:
    mlp.gate_up = ColumnParallelLinear.from_linear(mlp.gate_up, topology, parts=2)
    mlp.down = RowParallelLinear.from_linear(mlp.down, topology)


def apply_tp(model: Decoder, topology: Topology) -> Decoder:
    """Convert `model`, built in full from the run's seed on every rank, to tensor-parallel in place.

    Afterwards each rank holds its shard of every split parameter; the forward with labels returns
    the same (replicated) loss as the full model, and without labels the full logits.
    """
    vocab = model.embed.weight.shape[0]
    if vocab % topology.tp_size:
        raise ValueError(f"vocabulary {vocab} does not split over tensor-parallel size {topology.tp_size}")
    r, k = topology.tp_rank, topology.tp_size
    vocab_start = r * (vocab // k)
    # With tied embeddings the output reads embed.weight, so replacing the embedding keeps them tied.
    model.embed = VocabParallelEmbedding(shard(model.embed.weight, 0, r, k), vocab_start, topology.tp_group)
    if model.lm_head is not None:  # only its weight is read (by the output), so slice the weight
        model.lm_head.weight = sharded_parameter(shard(model.lm_head.weight, 0, r, k))
        model.lm_head.out_features = vocab // k
    model.output = VocabParallelOutput(vocab_start, topology.tp_group)
    sharded: set[int] = set()
    for block in model.blocks:
        plan = _MIXER_PLANS.get(type(block.mixer))
        if plan is None:
            raise ValueError(f"no tensor-parallel plan for mixer {type(block.mixer).__name__}")
        plan(block.mixer, topology, sharded)
        _shard_mlp(block.mlp, topology)
    return model
