"""How tensor parallelism may split a module, declared by the module itself (data, no parallel code).

Each mixer and the MLP return a `TensorParallelPlan` from `tp_plan()`; megabam/parallel/
tensor_parallel.py `apply_tp` interprets it: it swaps the named submodules for their parallel
versions and shards the named per-head tensors, so a new mixer brings its own plan and no parallel
pass edits model attributes (modules read their local head counts from their tensors' shapes).
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorParallelPlan:
    """Attribute names of one module, by how tensor parallelism splits them. Every split keeps whole
    heads (and whole SwiGLU hidden units) on each rank.

    - column: nn.Linear → column-parallel (output features split). The value lists the fused blocks
      along the output, kept aligned: a count of equal blocks, or their sizes (a fused [q | k | v]
      with fewer key/value heads).
    - row: bias-free nn.Linear → row-parallel (input features split, partial outputs summed).
    - channels: depthwise nn.Conv1d → its channels split, fused blocks as for `column`.
    - heads: parameters or buffers with the head dimension first, or submodules all of whose own
      tensors are (a BAM prior; a module shared by several layers is split once). None is skipped.
    - entry: an nn.Identity through which the module's input enters every column-parallel linear
      at once (one backward all-reduce instead of one per projection); None = each enters alone.
    - head_counts: what each split is in heads ({"attention": 8}), checked to divide the TP size.
    """

    column: dict[str, int | list[int]] = field(default_factory=dict)
    row: tuple[str, ...] = ()
    channels: dict[str, int] = field(default_factory=dict)
    heads: tuple[str, ...] = ()
    entry: str | None = None
    head_counts: dict[str, int] = field(default_factory=dict)
