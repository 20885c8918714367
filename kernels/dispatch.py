"""The entry points of the ops that have Triton kernels (BAM attention, the chunkwise mLSTM cell): the
kernel for CUDA tensors; on CPU, for attention, the fused C kernel (kernels/bam_attention_cpu.py,
"c_tiles": every prior, mask and SSMax variant) where its library builds and v's head width is q's,
except that calls torch's fused attention can compute (kernels/bam_attention_sdpa.py: no prior, or a
fixed one) go to torch where the kernel was built for vectors narrower than 512 bits (measured faster
than torch with AVX-512, not measured against it without); else torch's fused attention where it
applies; else the PyTorch reference (the tiled op). RMS norms, the SwiGLU product and the rotary embedding take
their one-pass C forms on CPU (kernels/cpu_fused.py, "c_fused") where its library builds, else their
PyTorch forms.

Mode `auto` makes that choice; `triton` or `reference` (the PyTorch reference everywhere, the oracle
of the kernels' tests) forces one. The mode comes from the config key `model.kernels` (passed here as
`backend`) or the environment variable MEGABAM_KERNELS, which wins when set so a run can be switched
without editing its config. Each op's choice is logged once per process (per mode and choice).
"""

import importlib
import logging
import os
from dataclasses import replace

from torch import Tensor

from megabam.kernels import bam_attention_sdpa
from megabam.kernels.bam_attention import AttentionOptions, bam_attention
from megabam.kernels.mlstm import MLstmState
from megabam.kernels.mlstm import mlstm_chunkwise as mlstm_chunkwise_reference
from megabam.kernels.precision import compute_dtype

ENV = "MEGABAM_KERNELS"
MODES = ("auto", "triton", "reference")
# Imported on first use: the CPU path never needs Triton, the interpreter flag is read when a kernel
# module is imported, and code that runs without megabam (the Hugging Face export, which ships these
# ops with mode `reference`) never names the kernel modules in an import statement.
TRITON_KERNELS = {
    "attention": ("megabam.kernels.bam_attention_triton", "bam_attention_triton"),
    "mlstm": ("megabam.kernels.mlstm_triton", "mlstm_chunkwise_triton"),
}
C_TILES = "megabam.kernels.bam_attention_cpu"  # imported on first use too: the export does not ship it
CPU_FUSED = "megabam.kernels.cpu_fused"  # likewise

SDPA_MIN_BLOCK = 256  # query rows per fused call at least (see attention)

log = logging.getLogger(__name__)
logged_choices: set = set()  # (op, mode, choice) already logged by this process


def choose(
    backend: str, tensor: Tensor, op: str = "attention", sdpa_applies: bool = False, c_tiles_apply=lambda: False
) -> str:
    """'triton', 'sdpa', 'c_tiles' or 'reference' for a call of `op` on `tensor` under the configured
    mode `backend`; `c_tiles_apply()`: whether the C kernel can compute this call (asked only in mode
    auto on CPU, where it is built on first use); `sdpa_applies`: whether torch's fused attention can."""
    mode = mode_of(backend)
    if mode != "auto":
        choice = mode
    elif tensor.is_cuda:
        choice = "triton"
    else:
        choice = "c_tiles" if c_tiles_apply() else "sdpa" if sdpa_applies else "reference"
    # Off the GPU a Triton launch only works under the interpreter (tests, debugging).
    if choice == "triton" and not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"Triton kernels on {tensor.device} tensors need TRITON_INTERPRET=1 "
            f"(mode {mode!r}); use {ENV}=reference or auto"
        )
    log_choice(op, mode, choice, tensor)
    return choice


def mode_of(backend: str) -> str:
    """The mode in force: MEGABAM_KERNELS when set, else `backend` (model.kernels); checked."""
    mode = os.environ.get(ENV) or backend
    if mode not in MODES:
        source = ENV if os.environ.get(ENV) else "model.kernels"
        raise ValueError(f"{source} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def log_choice(op: str, mode: str, choice: str, tensor: Tensor) -> None:
    if (op, mode, choice) not in logged_choices:
        logged_choices.add((op, mode, choice))
        log.info("%s op: %s (mode %s, %s tensors)", op, choice, mode, tensor.device.type)


def fused_cpu_op(op: str, backend: str, *tensors: Tensor):
    """The C form of `op` ("rms_norm", "swiglu", "rope"; kernels/cpu_fused.py) where it takes these tensors: in
    mode auto, CPU tensors of one dtype, fp32 or fp64, its library built (now, on first use); else None,
    and the caller computes the PyTorch form (megabam/model/layers.py, positional.py), as on CUDA, where torch's own
    kernels are fast, and in mode reference or triton (there is no Triton kernel for these). Logged
    once per op, mode and choice like the others."""
    mode = mode_of(backend)
    module = importlib.import_module(CPU_FUSED) if mode == "auto" and tensors[0].device.type == "cpu" else None
    fused = module is not None and module.applies(*tensors) and module.library() is not None
    log_choice(op, mode, "c_fused" if fused else "reference", tensors[0])
    return getattr(module, op) if fused else None


def triton_kernel(op: str):
    """The Triton kernel of `op` ("attention", "mlstm"), its module imported now (TRITON_KERNELS)."""
    module, name = TRITON_KERNELS[op]
    return getattr(importlib.import_module(module), name)


def c_tiles_built() -> bool:
    """Whether the C tiles' library is built (building it now, on first use, if it can be)."""
    return importlib.import_module(C_TILES).library() is not None


def c_tiles_wide() -> bool:
    """Whether the C kernel was built for 512-bit vectors (kernels/bam_attention_cpu.wide_vectors)."""
    return importlib.import_module(C_TILES).wide_vectors()


def attention(
    q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions = AttentionOptions(), *, backend: str = "auto"
) -> Tensor:
    """BAM attention on the op that `choose` picks: `options` (AttentionOptions) and the result are
    those of megabam.kernels.bam_attention.bam_attention, which the other ops share."""
    sdpa_applies = bam_attention_sdpa.applies(options)

    def c_tiles_apply() -> bool:
        return v.shape[-1] == q.shape[-1] and c_tiles_built() and (not sdpa_applies or c_tiles_wide())

    choice = choose(backend, q, sdpa_applies=sdpa_applies, c_tiles_apply=c_tiles_apply)
    if choice == "c_tiles":
        op = importlib.import_module(C_TILES).bam_attention_cpu
    elif choice == "triton":
        op = triton_kernel("attention")
    elif choice == "sdpa":
        op = bam_attention_sdpa.bam_attention_sdpa
        # Its memory does not grow with the query block (the masks are views, the tiles its own), and
        # each fused call costs a fixed ~0.3 ms: below SDPA_MIN_BLOCK rows per call the calls cost more
        # than the masked work a larger diagonal block adds (docs/log/benchmarks-history.md, "CPU training speed").
        options = replace(options, block_size=max(options.block_size, SDPA_MIN_BLOCK))
    else:
        op = bam_attention
    return op(q, k, v, options)


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
    `choose(backend, q, "mlstm")` picks, q, k, v in the model's dtype and the gates in the compute dtype.

    The kernels take bf16/fp16 q, k, v as they come: their products then run on tensor cores (TF32,
    state and sums in fp32), 14-18× faster on an H200 than on fp32 inputs, within the TF32 floor of
    the fp32 reference (docs/benchmarks.md). The reference computes in compute_dtype, as every op."""
    if choose(backend, q, "mlstm") == "triton":
        op = triton_kernel("mlstm")
    else:
        op = mlstm_chunkwise_reference
        q, k, v = (t.to(compute_dtype(q)) for t in (q, k, v))
    return op(q, k, v, i, f, eps, chunk_size, state)
