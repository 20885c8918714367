"""The entry points of the ops that have Triton kernels (BAM attention, the chunkwise mLSTM cell): the
kernel for CUDA tensors, the PyTorch reference for CPU tensors.

The choice can be forced: the config key `model.kernels` (passed here as `backend`) or the
environment variable MEGABAM_KERNELS, which wins when set so a run can be switched without editing
its config. Each op's choice is logged once per process (per mode and choice).
"""

import logging
import os

from torch import Tensor

from megabam.kernels.bam_attention import bam_attention
from megabam.kernels.mlstm import MLstmState
from megabam.kernels.mlstm import mlstm_chunkwise as mlstm_chunkwise_reference

ENV = "MEGABAM_KERNELS"
MODES = ("auto", "triton", "reference")

log = logging.getLogger(__name__)
logged_choices: set = set()  # (op, mode, choice) already logged by this process


def choose(backend: str, tensor: Tensor, op: str = "attention") -> str:
    """'triton' or 'reference' for a call of `op` on `tensor` under the configured mode `backend`."""
    mode = os.environ.get(ENV) or backend
    if mode not in MODES:
        source = ENV if os.environ.get(ENV) else "model.kernels"
        raise ValueError(f"{source} must be one of {', '.join(MODES)}, got {mode!r}")
    choice = mode if mode != "auto" else ("triton" if tensor.is_cuda else "reference")
    # Off the GPU a Triton launch only works under the interpreter (tests, debugging).
    if choice == "triton" and not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"Triton kernels on {tensor.device} tensors need TRITON_INTERPRET=1 "
            f"(mode {mode!r}); use {ENV}=reference or auto"
        )
    if (op, mode, choice) not in logged_choices:
        logged_choices.add((op, mode, choice))
        log.info("%s op: %s (mode %s, %s tensors)", op, choice, mode, tensor.device.type)
    return choice


def attention(q: Tensor, k: Tensor, v: Tensor, *, backend: str = "auto", **options) -> Tensor:
    """BAM attention on the op that `choose(backend, q)` picks: `options` (theta_alpha, theta_beta,
    theta_mu, ssmax_s, ssmax_before_prior, doc_ids, window, block_size, scale) and the result are
    those of megabam.kernels.bam_attention.bam_attention, which the Triton op shares."""
    if choose(backend, q) == "triton":
        # Imported on first use: the CPU path never needs Triton, and the interpreter flag is read
        # when the kernel module is imported.
        from megabam.kernels.bam_attention_triton import bam_attention_triton as op
    else:
        op = bam_attention
    return op(q, k, v, **options)


def mlstm_chunkwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    i: Tensor,
    f: Tensor,
    eps: float,
    chunk_size: int,
    state: MLstmState | None = None,
    *,
    backend: str = "auto",
) -> tuple[Tensor, MLstmState]:
    """The chunkwise mLSTM cell (arguments and result of megabam.kernels.mlstm.mlstm_chunkwise) on the op that
    `choose(backend, q, "mlstm")` picks."""
    if choose(backend, q, "mlstm") == "triton":
        from megabam.kernels.mlstm_triton import mlstm_chunkwise_triton as op  # lazily, as for attention
    else:
        op = mlstm_chunkwise_reference
    return op(q, k, v, i, f, eps, chunk_size, state)
