"""The Gated DeltaNet mixer (arXiv 2412.06464) and two equivalent forms of its cell.

Cell, per head, state S (d_k × d_v), L2-normalised q, k:

    S ← exp(g_t)·S;   v'_t = β_t (v_t − Sᵀk_t);   S ← S + k_t v'_tᵀ;   o_t = Sᵀ(q_t/√d_k)

- `gated_delta_recurrent`: that loop, one step at a time (inference, constant-size state);
- `gated_delta_chunkwise`: chunks of `chunk_size` steps (training). Inside a chunk with incoming
  state S0 and G_t = Σ_{r≤t} g_r, the written values U = (v'_t) solve the unit lower-triangular
  system (I + A) U = β⊙(V − exp(G)⊙K S0), A_ts = β_t·exp(G_t − G_s)·k_t·k_s for s < t; then
  o_t = exp(G_t)·S0ᵀq̃_t + Σ_{s≤t} exp(G_t − G_s)(q̃_t·k_s) U_s and
  S_end = exp(G_L)·S0 + Σ_s exp(G_L − G_s) k_s U_sᵀ.

Like the mLSTM, the layer ignores document boundaries (the state runs across packed documents).
"""
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megabam.config.schema import ModelConfig
from megabam.model.attention import SequenceInfo
from megabam.model.mlstm import compute_dtype, head_rms_norm


def gated_delta_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                          state: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """q, k (B, H, N, d_k), v (B, H, N, d_v), g ≤ 0 and β (B, H, N); state S (B, H, d_k, d_v) or None
    (zeros). Returns (o (B, H, N, d_v), final S)."""
    B, H, N, dk = q.shape
    S = q.new_zeros(B, H, dk, v.shape[-1]) if state is None else state
    q = q * dk ** -0.5
    out = []
    for t in range(N):
        S = torch.exp(g[..., t])[..., None, None] * S
        kt = k[..., t, :]
        written = beta[..., t, None] * (v[..., t, :] - (kt[..., None, :] @ S).squeeze(-2))
        S = S + kt[..., :, None] * written[..., None, :]
        out.append((q[..., t, None, :] @ S).squeeze(-2))
    return torch.stack(out, dim=-2), S


def gated_delta_chunkwise(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int,
                          state: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The same function as `gated_delta_recurrent`, computed chunk by chunk (the last may be shorter)."""
    B, H, N, dk = q.shape
    S = q.new_zeros(B, H, dk, v.shape[-1]) if state is None else state
    q = q * dk ** -0.5
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
        U = torch.linalg.solve_triangular(A + torch.eye(L, dtype=A.dtype, device=A.device), rhs,
                                          upper=False, unitriangular=True)
        out.append(torch.exp(G)[..., None] * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * decay) @ U)
        S = torch.exp(G[..., -1])[..., None, None] * S + (kc * decay[..., -1, :, None]).transpose(-1, -2) @ U
    return torch.cat(out, dim=-2), S


class GatedDeltaNetState(NamedTuple):
    """S (B, H, d_k, d_v) and the last conv_size - 1 inputs of the short convolutions (B, K-1, 3d)."""

    S: Tensor
    conv: Tensor


class GatedDeltaNet(nn.Module):
    """q, k, v projections through short causal depthwise convolutions and SiLU; L2-normalised q, k;
    decay g = −exp(A)·softplus(a(x) + dt_bias) ≤ 0 and β = σ(b(x)) per head; the cell; per-head RMS
    norm gated by SiLU(gate(x)); output projection. Per-head tensors keep the head dimension first."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c, d = cfg.gated_deltanet, cfg.d_model
        self.n_heads = c.n_heads or cfg.n_heads
        self.head_dim = d // self.n_heads
        self.chunk_size, self.conv_size, self.norm_eps = c.chunk_size, c.conv_size, cfg.norm_eps
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.conv = nn.Conv1d(3 * d, 3 * d, c.conv_size, groups=3 * d, bias=False)
        self.a = nn.Linear(d, self.n_heads, bias=False)
        self.b = nn.Linear(d, self.n_heads, bias=False)
        # Decay rates spread over heads: A in [1, 16], softplus(dt_bias) in [1e-3, 0.1] (the paper's ranges,
        # set evenly rather than drawn, so heads start with time scales from ~1 to ~1000 steps).
        self.A_log = nn.Parameter(torch.linspace(1.0, 16.0, self.n_heads).log())
        dt = torch.exp(torch.linspace(math.log(1e-3), math.log(0.1), self.n_heads))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
        self.gate = nn.Linear(d, d, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(self.n_heads * self.head_dim))  # head-major
        self.out = nn.Linear(d, d, bias=False)
        # Where x enters the four projections that read it: the identity here; tensor parallelism
        # makes it the one collective they share (megabam/parallel/tensor_parallel.py).
        self.enter = nn.Identity()

    def _inputs(self, x: Tensor, conv_cache: Optional[Tensor]) -> tuple[tuple[Tensor, ...], Tensor]:
        """(q, k, v (B, H, N, D), g, β (B, H, N)) and the new convolution cache."""
        B, N, _ = x.shape
        qkv = self.qkv(x)
        if conv_cache is None:
            conv_cache = qkv.new_zeros(B, self.conv_size - 1, qkv.shape[-1])
        padded = torch.cat([conv_cache, qkv], dim=1)
        qkv = F.silu(self.conv(padded.transpose(1, 2)).transpose(1, 2))
        q, k, v = (t.view(B, N, self.n_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        g = (-torch.exp(self.A_log) * F.softplus(self.a(x) + self.dt_bias)).transpose(1, 2)
        beta = torch.sigmoid(self.b(x)).transpose(1, 2)
        return (q, k, v, g, beta), padded[:, padded.shape[1] - (self.conv_size - 1):]

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        B, N, _ = x.shape
        o = head_rms_norm(o, self.norm_weight, self.norm_eps).transpose(1, 2).reshape(B, N, -1)
        return self.out(F.silu(self.gate(x)) * o)

    def forward(self, x: Tensor, seq: SequenceInfo) -> Tensor:
        return self.stream(x, None, seq)[0]

    def stream(self, x: Tensor, state: Optional[GatedDeltaNetState], seq: SequenceInfo) -> tuple[Tensor, GatedDeltaNetState]:
        """Continue from `state` (None = start) over x (B, N, d); returns (output, state after the last
        step). Several steps run the chunkwise form, a single step (generation) the recurrent one."""
        x = self.enter(x)
        inputs, conv = self._inputs(x, None if state is None else state.conv)
        inputs = [t.to(compute_dtype(x)) for t in inputs]
        S = None if state is None else state.S
        if x.shape[1] == 1:
            o, S = gated_delta_recurrent(*inputs, S)
        else:
            o, S = gated_delta_chunkwise(*inputs, self.chunk_size, S)
        return self._output(x, o.to(x.dtype)), GatedDeltaNetState(S, conv)

    def flops_per_token(self, seq_len: int) -> float:
        """Forward+backward FLOPs per token of the chunkwise cell: k·k, q·k, the triangular solve and
        scores·U within half a chunk on average, k·S, q·S and the state update once per step."""
        chunk, D = min(self.chunk_size, seq_len), self.head_dim
        return 3 * self.n_heads * (4 * chunk * D + 6 * D * D)


def build_gated_deltanet(cfg: ModelConfig, shared: dict) -> GatedDeltaNet:
    return GatedDeltaNet(cfg)
