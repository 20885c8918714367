"""The mLSTM cell in pure PyTorch, in three equivalent forms: the reference the Triton kernel
(kernels/mlstm_triton.py) is tested against and the op CPU tensors run (kernels/dispatch.py).

Cell, per head (docs/methods.md §3), with log forget gate lf_t = logσ(f_t):

    m_t = max(lf_t + m_{t-1}, i_t)                                   m_0 = -inf
    C_t = exp(lf_t + m_{t-1} - m_t)·C_{t-1} + exp(i_t - m_t)·k_t v_tᵀ
    n_t = exp(lf_t + m_{t-1} - m_t)·n_{t-1} + exp(i_t - m_t)·k_t
    h_t = (q̃_tᵀ C_t) / (max(|q̃_t·n_t|, exp(-m_t)) + eps),            q̃ = q/√d_qk

Unrolled, key s reaches step t with log weight D_ts = Σ_{s<r≤t} lf_r + i_s, and m_t = max_{s≤t} D_ts:
the stabiliser is the row maximum of D. The three forms compute exactly that:
- `mlstm_parallel`: the whole (N, N) matrix D at once (quadratic; the reference for tests);
- `mlstm_chunkwise`: D inside chunks of `chunk_size` steps, the state (C, n, m) carried between
  chunks (training; cost N·chunk_size); takes and returns the state;
- `mlstm_recurrent` / `mlstm_step`: one step at a time with a constant-size state (inference).
C and n are kept scaled by exp(-m) (the true sums are exp(m)·C, exp(m)·n) so nothing overflows.
Tested against a float64 loop over time in tests/unit/test_mlstm.py.
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class MLstmState(NamedTuple):
    """Cell state per head: C (B, H, d_qk, d_v) and n (B, H, d_qk), both scaled by exp(-m); m (B, H)."""

    C: Tensor
    n: Tensor
    m: Tensor


def initial_mlstm_state(batch: int, heads: int, qk_dim: int, v_dim: int, dtype, device) -> MLstmState:
    """The empty state: C = 0, n = 0, m = -inf."""
    return MLstmState(
        torch.zeros(batch, heads, qk_dim, v_dim, dtype=dtype, device=device),
        torch.zeros(batch, heads, qk_dim, dtype=dtype, device=device),
        torch.full((batch, heads), -math.inf, dtype=dtype, device=device),
    )


def _read(num: Tensor, qn: Tensor, m: Tensor, eps: float) -> Tensor:
    """h = num / (max(|q̃·n|, exp(-m)) + eps); num (..., d_v), qn and m (...)."""
    return num / (torch.maximum(qn.abs(), torch.exp(-m)) + eps)[..., None]


def mlstm_parallel(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, eps: float) -> Tensor:
    """All steps at once. q, k (B, H, N, d_qk), v (B, H, N, d_v), gate pre-activations i, f (B, H, N)."""
    n = q.shape[-2]
    cum = F.logsigmoid(f).cumsum(-1)
    log_w = cum[..., :, None] - cum[..., None, :] + i[..., None, :]  # D_ts
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    log_w = log_w.masked_fill(~causal, -math.inf)
    m = log_w.amax(-1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 * torch.exp(log_w - m[..., None])
    return _read(scores @ v, scores.sum(-1), m, eps)


def mlstm_chunkwise(
    q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, eps: float, chunk_size: int, state: MLstmState | None = None
) -> tuple[Tensor, MLstmState]:
    """Chunks of `chunk_size` steps (the last may be shorter) starting from `state` (None = empty);
    returns (h (B, H, N, d_v), the state after the last step)."""
    B, H, N, dqk = q.shape
    if state is None:
        state = initial_mlstm_state(B, H, dqk, v.shape[-1], q.dtype, q.device)
    C, nrm, m = state
    q = q * dqk**-0.5
    lf = F.logsigmoid(f)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    out = []
    for start in range(0, N, chunk_size):
        sl = slice(start, start + chunk_size)
        qc, kc, vc, ic = q[..., sl, :], k[..., sl, :], v[..., sl, :], i[..., sl]
        L = qc.shape[-2]
        b = lf[..., sl].cumsum(-1)  # decay from the chunk start to each step, in log space
        intra = (b[..., :, None] - b[..., None, :] + ic[..., None, :]).masked_fill(~causal[:L, :L], -math.inf)
        carried = b + m[..., None]  # log weight of the incoming state at each step
        m_row = torch.maximum(carried, intra.amax(-1))
        scores = (qc @ kc.transpose(-1, -2)) * torch.exp(intra - m_row[..., None])
        carry = torch.exp(carried - m_row)
        num = scores @ vc + carry[..., None] * (qc @ C)
        qn = scores.sum(-1) + carry * (qc @ nrm[..., None]).squeeze(-1)
        out.append(_read(num, qn, m_row, eps))
        # State after the chunk's last step: its stabiliser is that row's m.
        m_end = m_row[..., -1]
        key_weight = torch.exp(b[..., -1:] - b + ic - m_end[..., None])[..., None] * kc
        state_decay = torch.exp(b[..., -1] + m - m_end)
        C = state_decay[..., None, None] * C + key_weight.transpose(-1, -2) @ vc
        nrm = state_decay[..., None] * nrm + key_weight.sum(-2)
        m = m_end
    return torch.cat(out, dim=-2), MLstmState(C, nrm, m)


def mlstm_step(
    q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, eps: float, state: MLstmState
) -> tuple[Tensor, MLstmState]:
    """One step: q, k (B, H, d_qk), v (B, H, d_v), i, f (B, H); returns (h (B, H, d_v), new state)."""
    C, nrm, m = state
    lf = F.logsigmoid(f)
    m_new = torch.maximum(lf + m, i)
    decay, gain = torch.exp(lf + m - m_new), torch.exp(i - m_new)
    C = decay[..., None, None] * C + gain[..., None, None] * k[..., :, None] * v[..., None, :]
    nrm = decay[..., None] * nrm + gain[..., None] * k
    q = q * q.shape[-1] ** -0.5
    return _read((q[..., None, :] @ C).squeeze(-2), (q * nrm).sum(-1), m_new, eps), MLstmState(C, nrm, m_new)


def mlstm_recurrent(
    q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, eps: float, state: MLstmState | None = None
) -> tuple[Tensor, MLstmState]:
    """`mlstm_step` over every step of (B, H, N, ·) inputs; returns (h (B, H, N, d_v), final state)."""
    B, H, N, dqk = q.shape
    if state is None:
        state = initial_mlstm_state(B, H, dqk, v.shape[-1], q.dtype, q.device)
    out = []
    for t in range(N):
        h, state = mlstm_step(q[..., t, :], k[..., t, :], v[..., t, :], i[..., t], f[..., t], eps, state)
        out.append(h)
    return torch.stack(out, dim=-2), state
