"""The Gated DeltaNet cell of kernels/gated_deltanet.py on flash-linear-attention's Triton kernels
(package `fla-core`, module `fla`; installed by `pip install 'megabam[gpu]'`), with megabam's
arguments and results: the op the dispatch runs on CUDA tensors (kernels/dispatch.py).

How megabam's parametrization maps onto fla's (so a model trained through one path evaluates the
same through the other; tested against the float64 loop, tests/unit/test_library_kernels.py):
- layout: megabam's per-head tensors are (B, H, N, d) views of (B, N, H, d) projections, fla takes
  (B, N, H, d): the transpose back is a view, and the output's transpose a view again;
- q, k L2 norm: the mixer normalises them itself (F.normalize: x / max(|x|, 1e-12), unit length down
  to |x| = 1e-12) and fla's in-kernel norm is left off (use_qk_l2norm_in_kernel=False), since fla's
  x·rsqrt(|x|² + 1e-6) shrinks short vectors (|x| = 1e-3 comes out at length 0.71);
- scale 1/√d_k on q (fla's default, passed explicitly); g is the log decay (≤ 0) and β the rate
  after its sigmoid in both; the decay's activation stays in the mixer (fla's use_gate_in_kernel off);
- state S (B, H, d_k, d_v), fla's default layout (state_v_first off), in and out in fp32;
- chunk: fla's own (64), whatever the mixer's chunk_size (the same function, rounded differently).
fla computes in fp32 whatever q, k, v's dtype (bf16 in training) and returns o in v's dtype.
"""

import importlib

from torch import Tensor

# fla's import takes ~1.5 s and finds no GPU on CPU machines: imported on first use.
FLA_OPS = "fla.ops.gated_delta_rule"


def gated_delta_chunkwise_fla(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """kernels/gated_deltanet.py::gated_delta_chunkwise on fla's `chunk_gated_delta_rule` (training
    and multi-token streaming): q, k (B, H, N, d_k) L2-normalised, v (B, H, N, d_v), g, β (B, H, N),
    state (B, H, d_k, d_v) or None; returns (o (B, H, N, d_v), final state)."""
    fla = importlib.import_module(FLA_OPS)
    o, S = fla.chunk_gated_delta_rule(**_fla_arguments(q, k, v, g, beta, state))
    return o.transpose(1, 2), S


def gated_delta_recurrent_fla(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """kernels/gated_deltanet.py::gated_delta_recurrent on fla's `fused_recurrent_gated_delta_rule`
    (generation, one step at a time); the arguments and results of gated_delta_chunkwise_fla."""
    fla = importlib.import_module(FLA_OPS)
    o, S = fla.fused_recurrent_gated_delta_rule(**_fla_arguments(q, k, v, g, beta, state))
    return o.transpose(1, 2), S


def _fla_arguments(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None) -> dict:
    """fla's keyword arguments (by name: its two functions order them differently): the (B, H, N, ·)
    and (B, H, N) tensors as its (B, N, H, ·) and (B, N, H) views, and the mapping above."""
    return dict(
        q=q.transpose(1, 2),
        k=k.transpose(1, 2),
        v=v.transpose(1, 2),
        g=g.transpose(1, 2),
        beta=beta.transpose(1, 2),
        scale=q.shape[-1] ** -0.5,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
