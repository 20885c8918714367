"""What the tensor- and sequence-parallel tests share: sizes, tolerances, batches, and the gathering
of shards back into whole tensors (by parameter name, independent of apply_tp)."""

import torch
import torch.distributed as dist

from megabam.parallel.topology import Topology

V, SEQ, BATCH, SEED, STEPS = 64, 32, 2, 7, 3
LOSS_RTOL = 1e-5  # relative, per step
GRAD_ATOL = 1e-5  # absolute, per gradient element (the largest gradients here are ~0.1)


# The BAM variant every TP/SP comparison trains: learnable prior (θ_μ too) and SSMax.
BAM = [
    "model.layer_pattern=[attention]",
    "model.attention.positional=ggd_bam",
    "model.attention.bam.init=spread",
    "model.attention.bam.learn_mu=true",
    "model.attention.ssmax=true",
]

# How each parameter is split, by name (independent of apply_tp): dim 0 in fused blocks, dim 1, or
# replicated. Everything not listed is split along dim 0 in one block.
FUSED_BLOCKS = {"qkv.weight": 3, "gate_up.weight": 2}
# A convolution's channels by the mixer that holds it: [q | k | v] in Gated DeltaNet, [q | k] in the mLSTM.
CONV_BLOCKS = {"GatedDeltaNet": 3, "MLstm": 2}
SPLIT_INPUTS = ("out.weight", "down.weight")
REPLICATED = ("mixer_norm.weight", "mlp_norm.weight")


def count_parameters(model: torch.nn.Module, topology: Topology) -> int:
    """Collective over the tensor-parallel group: the whole model's parameter count from the shards
    (summed over the ranks) and the replicated parameters (counted once), so a test can check that
    sharding neither lost nor duplicated anything."""
    marked = [getattr(p, "tensor_model_parallel", False) for p in model.parameters()]
    sharded = torch.tensor([sum(p.numel() for p, m in zip(model.parameters(), marked) if m)])
    dist.all_reduce(sharded, group=topology.tp_group)
    return int(sharded) + sum(p.numel() for p, m in zip(model.parameters(), marked) if not m)


def shard_blocks(full: torch.nn.Module, name: str, tp: int) -> list[int] | None:
    """The fused row blocks of a TP shard of parameter `name` of the whole model `full` where the name
    alone does not tell them: an attention projection with fewer kv heads ([q | k | v] of unequal
    sizes) and a convolution (its mixer's CONV_BLOCKS); None elsewhere."""
    if not name.endswith(("qkv.weight", "conv.weight")):
        return None
    owner = full.get_submodule(name.rsplit(".", 2)[0])
    if name.endswith("conv.weight"):
        parts = CONV_BLOCKS[type(owner).__name__]
        return [owner.conv.weight.shape[0] // parts // tp] * parts
    kv_heads, heads = getattr(owner, "kv_heads", None), getattr(owner, "n_heads", None)
    if kv_heads is None or kv_heads == heads or not hasattr(owner, "head_dim"):
        return None
    q, kv = heads * owner.head_dim // tp, kv_heads * owner.head_dim // tp
    return [q, kv, kv]


def gather_shards(name: str, local: torch.Tensor, group, blocks=None) -> torch.Tensor:
    """The full tensor from every rank's shard of parameter `name` (or gradient); `blocks` lists the
    shard's fused row blocks where the name does not tell them (shard_blocks)."""
    if name == "norm.weight" or name.endswith(REPLICATED):
        return local
    if blocks is None and name.endswith("conv.weight"):
        raise ValueError(f"{name}: a convolution's blocks depend on its mixer; pass shard_blocks(...)")
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    if name.endswith(SPLIT_INPUTS):
        return torch.cat(shards, 1)
    if blocks is None:
        parts = next((n for suffix, n in FUSED_BLOCKS.items() if name.endswith(suffix)), 1)
        blocks = [local.shape[0] // parts] * parts
    pieces = [s.split(blocks, 0) for s in shards]
    return torch.cat([torch.cat([b[p] for b in pieces], 0) for p in range(len(blocks))], 0)


def make_batch(step: int):
    """Tokens, labels and two packed documents per row; every TP rank draws the same."""
    g = torch.Generator().manual_seed(1000 + step)
    ids, labels = torch.randint(0, V, (2, BATCH, SEQ), generator=g)
    doc_ids = (torch.arange(SEQ) >= 13).long().expand(BATCH, SEQ)
    return ids, labels, doc_ids
