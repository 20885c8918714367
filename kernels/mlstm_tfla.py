"""The mLSTM cell of kernels/mlstm.py on NX-AI's TFLA kernels (package `mlstm-kernels`, module
`mlstm_kernels`; installed by `pip install 'megabam[gpu]'`), with megabam's arguments and results:
the op the dispatch runs on CUDA tensors where they work (kernels/dispatch.py), megabam's own Triton
kernel (kernels/mlstm_triton.py) otherwise.

TFLA computes the same cell as kernels/mlstm.py (xLSTM-7B's: log-sigmoid forget gate, exp input gate,
the row-max stabiliser m, h = q̃C / (max(|q̃·n|, exp(−m)) + eps), q̃ = q/√d_qk, C and n kept scaled by
exp(−m)). What differs, and how it is mapped (tested against the float64 loop through the library's
own PyTorch forms, which share its kernels' signatures, tests/unit/test_library_kernels.py):
- the empty state: megabam's starts at m = −inf, TFLA's (no initial state given) at m = 0. With
  C = n = 0 that changes only the eps term: in unscaled terms h = num / (max(|q̃·n|, 1) + eps·exp(m)),
  so h differs by at most eps relative, and the final C, n, m are the same state scaled by another
  exp(m). An empty state is therefore passed as None, TFLA's own start, not as m = −inf;
- the state's m is (B, H, 1) in TFLA, (B, H) in megabam;
- the length: TFLA's chunkwise kernel needs a multiple of its chunk; the sequence is padded at the
  end with steps that change nothing (input gate −1e30: exp(i − m) = 0; forget gate 1e4:
  log σ = 0 in fp32), their outputs dropped;
- gradients: TFLA treats each chunk's stabiliser as a constant; megabam's kernel carries the exact
  gradient through m. The two differ only through the eps term and through gradients that reach the
  returned (scaled) final state, which training never has;
- dtypes: q, k, v as the model gives them (bf16 in training: tensor-core dots), the gates and the
  state in fp32; h comes back in fp32.
TFLA's kernels use Triton's block pointers, which Triton 3.9 removed (its interpreter raises on
them): they run on the GPU image's Triton 3.6, not on this machine's (`usable`).
"""

import importlib
import importlib.util

import torch
from torch import Tensor

from megabam.kernels.mlstm import MLstmState

CHUNKWISE = ("mlstm_kernels.torch.chunkwise.triton_xl_chunk", "mlstm_chunkwise__xl_chunk")
STEP = ("mlstm_kernels.torch.recurrent.triton_step", "mlstm_recurrent_step__triton")
PAD_INPUT_GATE, PAD_FORGET_GATE = -1e30, 1e4


def usable() -> bool:
    """Whether TFLA can run here: mlstm_kernels importable and Triton still has block pointers (the
    module is named by string, as the Hugging Face export bundles this file and needs no Triton)."""
    if importlib.util.find_spec("mlstm_kernels") is None:
        return False
    return "removed" not in (importlib.import_module("triton.language").make_block_ptr.__doc__ or "")


def mlstm_chunkwise_tfla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    i: Tensor,
    f: Tensor,
    eps: float,
    chunk_size: int,
    state: MLstmState | None = None,
) -> tuple[Tensor, MLstmState]:
    """kernels/mlstm.py::mlstm_chunkwise on TFLA's xl_chunk kernel (CHUNKWISE): q, k (B, H, N, d_qk),
    v (B, H, N, d_v), gate pre-activations i, f (B, H, N), state or None; returns (h (B, H, N, d_v),
    the state after the last step)."""
    op = _library(CHUNKWISE)
    n = q.shape[-2]
    pad = -n % chunk_size
    if pad:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        i = torch.nn.functional.pad(i, (0, pad), value=PAD_INPUT_GATE)
        f = torch.nn.functional.pad(f, (0, pad), value=PAD_FORGET_GATE)
    C, nrm, m = (None, None, None) if state is None else (state.C, state.n, state.m[..., None])
    h, (C, nrm, m) = op(
        q,
        k,
        v,
        i,
        f,
        c_initial=C,
        n_initial=nrm,
        m_initial=m,
        return_last_states=True,
        eps=eps,
        chunk_size=chunk_size,
    )
    return h[..., :n, :], MLstmState(C, nrm, m[..., 0])


def mlstm_step_tfla(
    q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, eps: float, state: MLstmState
) -> tuple[Tensor, MLstmState]:
    """kernels/mlstm.py::mlstm_step on TFLA's step kernel (STEP): q, k (B, H, d_qk),
    v (B, H, d_v), i, f (B, H), a state (not None: the caller makes the empty one); returns
    (h (B, H, d_v), the new state)."""
    h, (C, nrm, m) = _library(STEP)(
        q, k, v, i[..., None], f[..., None], state.C, state.n, state.m[..., None], eps=eps, dtype_state=state.C.dtype
    )
    return h, MLstmState(C, nrm, m[..., 0])


def _library(name: tuple[str, str]):
    """The library's function (module, name), imported now: its ~1 s import only where it runs. The
    tests point CHUNKWISE and STEP at its PyTorch forms, which take the same arguments."""
    module, function = name
    return getattr(importlib.import_module(module), function)
