"""The Gated DeltaNet cell (arXiv 2412.06464) in pure PyTorch, in two equivalent forms: the op its
mixer (megabam/model/gated_deltanet.py) runs on CPU, and the reference of the one it runs on CUDA
(flash-linear-attention's kernels, kernels/gated_deltanet_fla.py; kernels/dispatch.py chooses).

Cell, per head, state S (d_k × d_v), L2-normalised q, k:

    S ← exp(g_t)·S;   v'_t = β_t (v_t − Sᵀk_t);   S ← S + k_t v'_tᵀ;   o_t = Sᵀ(q_t/√d_k)

- `gated_delta_recurrent`: that loop, one step at a time (inference, constant-size state);
- `gated_delta_chunkwise`: chunks of `chunk_size` steps (training). Inside a chunk with incoming
  state S0 and G_t = Σ_{r≤t} g_r, the written values U = (v'_t) solve the unit lower-triangular
  system (I + A) U = β⊙(V − exp(G)⊙K S0), A_ts = β_t·exp(G_t − G_s)·k_t·k_s for s < t; then
  o_t = exp(G_t)·S0ᵀq̃_t + Σ_{s≤t} exp(G_t − G_s)(q̃_t·k_s) U_s and
  S_end = exp(G_L)·S0 + Σ_s exp(G_L − G_s) k_s U_sᵀ.

Tested against a float64 loop over time in the unit tests.
"""

import math

import torch
from torch import Tensor


def gated_delta_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """q, k (B, H, N, d_k), v (B, H, N, d_v), g ≤ 0 and β (B, H, N); state S (B, H, d_k, d_v) or None
    (zeros). Returns (o (B, H, N, d_v), final S)."""
    B, H, N, dk = q.shape
    S = q.new_zeros(B, H, dk, v.shape[-1]) if state is None else state
    q = q * dk**-0.5
    out = []
    for t in range(N):
        S = torch.exp(g[..., t])[..., None, None] * S
        kt = k[..., t, :]
        written = beta[..., t, None] * (v[..., t, :] - (kt[..., None, :] @ S).squeeze(-2))
        S = S + kt[..., :, None] * written[..., None, :]
        out.append((q[..., t, None, :] @ S).squeeze(-2))
    return torch.stack(out, dim=-2), S


def gated_delta_chunkwise(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The same function as `gated_delta_recurrent`, computed chunk by chunk (the last may be shorter)."""
    B, H, N, dk = q.shape
    S = q.new_zeros(B, H, dk, v.shape[-1]) if state is None else state
    q = q * dk**-0.5
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    out = []
    for start in range(0, N, chunk_size):
        sl = slice(start, start + chunk_size)
        qc, kc, vc, bc = q[..., sl, :], k[..., sl, :], v[..., sl, :], beta[..., sl]
        L = qc.shape[-2]
        G = g[..., sl].cumsum(-1)
        # exp(G_t - G_s) for s ≤ t; masked before exp because G_t - G_s > 0 above the diagonal.
        decay = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~causal[:L, :L], -math.inf))
        A = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        rhs = bc[..., None] * (vc - torch.exp(G)[..., None] * (kc @ S))
        U = torch.linalg.solve_triangular(
            A + torch.eye(L, dtype=A.dtype, device=A.device), rhs, upper=False, unitriangular=True
        )
        out.append(torch.exp(G)[..., None] * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * decay) @ U)
        S = torch.exp(G[..., -1])[..., None, None] * S + (kc * decay[..., -1, :, None]).transpose(-1, -2) @ U
    return torch.cat(out, dim=-2), S
