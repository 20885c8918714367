"""The entry points of the ops that have Triton kernels (BAM attention, the mLSTM and Gated DeltaNet
cells).

On CUDA tensors the mLSTM runs its kernel, and attention one of these (the first two are torch's
kernels, called from kernels/bam_attention_torch.py):
- "sdpa_cuda", full causal attention without a prior, window or documents, SSMax or not: one call
  of torch's scaled_dot_product_attention, which picks its flash, cuDNN or memory-efficient kernel;
- "flex", a window, documents or a fixed prior (ALiBi's slopes; any prior under no_grad):
  FlexAttention, compiled;
- "triton", the kernel: a learnable prior, a fixed one scaled by a learnable SSMax, and the calls
  of "flex" where dynamo is disabled (torch.compile then compiles nothing, and FlexAttention
  uncompiled materialises the N x N scores).

The recurrent cells on CUDA tensors take the field's kernels where their libraries are installed
(`pip install 'megabam[gpu]'`), each mapped onto megabam's parametrization in its own module:
Gated DeltaNet flash-linear-attention's ("fla", kernels/gated_deltanet_fla.py; without fla, the PyTorch
reference, with a warning), the mLSTM NX-AI's TFLA ("tfla", kernels/mlstm_tfla.py; without it, or on
a Triton without block pointers, megabam's own kernel "triton", with a warning). Mode `triton` forces
megabam's mLSTM kernel and fla's Gated DeltaNet kernels.

On CPU, for attention, the fused C kernel (kernels/bam_attention_cpu.py,
"c_tiles": every prior, mask and SSMax variant) where its library builds and v's head width is q's,
except that calls torch's fused attention can compute (kernels/bam_attention_sdpa.py: no prior, or a
fixed one) go to torch where the kernel was built for vectors narrower than 512 bits (measured faster
than torch with AVX-512, not measured against it without); else torch's fused attention where it
applies; else the PyTorch reference (the tiled op). RMS norms, the SwiGLU product and the rotary embedding take
their one-pass C forms on CPU (kernels/cpu_fused.py, "c_fused") where its library builds, else their
PyTorch forms, which inductor fuses where torch.compile traces them (train.compile; the attention and
mLSTM ops themselves run outside the compiled graphs, megabam/parallel/compile.py).

A call long enough to reach an SSMax key cap (AttentionOptions.ssmax_key_cap: past the training
length, so evaluation only) runs on an op that applies the cap: the Triton kernel on CUDA, the C
kernel on CPU where it applies, else the PyTorch reference (torch's kernels and FlexAttention do not
apply it; the dense ops of streaming inference do).

Mode `auto` makes that choice; `triton` or `reference` (the PyTorch reference everywhere, the oracle
of the kernels' tests) forces one. The mode comes from the config key `model.kernels` (passed here as
`backend`) or the environment variable MEGABAM_KERNELS, which wins when set so a run can be switched
without editing its config. Each op's choice is logged once per process (per mode, choice and, on
CUDA, the reason for it).
"""

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from megabam.kernels import bam_attention_sdpa, bam_attention_torch, gated_deltanet_fla, mlstm_tfla
from megabam.kernels.bam_attention import AttentionOptions, bam_attention
from megabam.kernels.gated_deltanet import gated_delta_chunkwise, gated_delta_recurrent
from megabam.kernels.mlstm import MLstmState, initial_mlstm_state, mlstm_recurrent
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
GPU_EXTRA = "pip install 'megabam[gpu]'"
C_TILES = "megabam.kernels.bam_attention_cpu"  # imported on first use too: the export does not ship it
CPU_FUSED = "megabam.kernels.cpu_fused"  # likewise

SDPA_MIN_BLOCK = 256  # query rows per fused call at least (see attention)

log = logging.getLogger(__name__)
logged_choices: set = set()  # (op, mode, choice, reason or None) already logged by this process


def choose(
    backend: str,
    tensor: Tensor,
    op: str = "attention",
    sdpa_applies: bool = False,
    c_tiles_apply=lambda: False,
    cuda_choice: Callable[[], tuple[str, str | None]] = lambda: ("triton", None),
) -> str:
    """'triton', 'sdpa_cuda', 'flex', 'sdpa', 'c_tiles' or 'reference' for a call of `op` on `tensor`
    under the configured mode `backend`; `cuda_choice()`: the op for CUDA tensors in mode auto and
    why; `c_tiles_apply()`: whether the C kernel can compute this call (asked only in mode auto on
    CPU, where it is built on first use); `sdpa_applies`: whether torch's fused attention can."""
    mode = mode_of(backend)
    why = None
    if mode != "auto":
        choice = mode
    elif on_cuda(tensor):
        choice, why = cuda_choice()
    else:
        choice = "c_tiles" if c_tiles_apply() else "sdpa" if sdpa_applies else "reference"
    # Off the GPU a Triton launch only works under the interpreter (tests, debugging).
    if choice == "triton" and not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"Triton kernels on {tensor.device} tensors need TRITON_INTERPRET=1 "
            f"(mode {mode!r}); use {ENV}=reference or auto"
        )
    log_choice(op, mode, choice, tensor, why)
    return choice


def on_cuda(tensor: Tensor) -> bool:
    """Whether the call is on CUDA tensors (the one place the dispatch asks; tests stand in for it)."""
    return tensor.is_cuda


def cuda_attention_choice(q: Tensor, k: Tensor, options: AttentionOptions) -> tuple[str, str]:
    """The attention op for CUDA tensors in mode auto, and why (the rule is the module docstring's)."""
    if options.prior_learnable:
        return "triton", "learnable prior"
    if bam_attention_torch.sdpa_causal_applies(options):
        backend = bam_attention_torch.sdpa_backend(q, k, options)
        return "sdpa_cuda", f"no prior, window or documents; torch picks {backend}"
    if not bam_attention_torch.flex_applies(options):
        return "triton", "learnable SSMax scales the prior"
    if dynamo_disabled():
        return "triton", "dynamo is disabled, and FlexAttention uncompiled would materialise N x N scores"
    return "flex", "window, documents or fixed prior"


def cuda_mlstm_choice() -> tuple[str, str]:
    """The mLSTM op for CUDA tensors in mode auto, and why: TFLA where it runs, else megabam's kernel."""
    if mlstm_tfla.usable():
        return "tfla", "mlstm_kernels' TFLA kernels"
    return library_missing(
        "mlstm", "triton", f"mlstm_kernels missing, or its Triton lacks block pointers ({GPU_EXTRA})"
    )


def cuda_gated_delta_choice() -> tuple[str, str]:
    """The Gated DeltaNet op for CUDA tensors in mode auto, and why: fla's kernels where installed."""
    if importlib.util.find_spec("fla") is not None:
        return "fla", "flash-linear-attention's kernels"
    return library_missing("gated_deltanet", "reference", f"flash-linear-attention missing ({GPU_EXTRA})")


def library_missing(op: str, fallback: str, why: str) -> tuple[str, str]:
    """(fallback, why), warning once per process that the field's kernel is not used."""
    if (op, "missing") not in logged_choices:
        logged_choices.add((op, "missing"))
        log.warning("%s on CUDA: %s; running %s instead", op, why, fallback)
    return fallback, why


def dynamo_disabled() -> bool:
    """Whether torch.compile would leave FlexAttention uncompiled: it returns the function as it is
    under TORCHDYNAMO_DISABLE=1 (read when torch.compile is called; the user's to set: megabam sets it
    only around one import, megabam/train/engine.py), and compiled code runs uncompiled under
    torch._dynamo.config.disable (TORCH_COMPILE_DISABLE=1, or set in code)."""
    import torch._dynamo  # here, not above: ~1 s of import that CPU processes never need

    return os.environ.get("TORCHDYNAMO_DISABLE") == "1" or torch._dynamo.config.disable


def mode_of(backend: str) -> str:
    """The mode in force: MEGABAM_KERNELS when set, else `backend` (model.kernels); checked."""
    mode = os.environ.get(ENV) or backend
    if mode not in MODES:
        source = ENV if os.environ.get(ENV) else "model.kernels"
        raise ValueError(f"{source} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def log_choice(op: str, mode: str, choice: str, tensor: Tensor, why: str | None = None) -> None:
    if (op, mode, choice, why) not in logged_choices:
        logged_choices.add((op, mode, choice, why))
        reason = f": {why}" if why else ""
        log.info("%s op: %s (mode %s, %s tensors)%s", op, choice, mode, tensor.device.type, reason)


def fused_cpu_op(op: str, backend: str, *tensors: Tensor):
    """The C form of `op` ("rms_norm", "swiglu", "rope"; kernels/cpu_fused.py) where it takes these tensors: in
    mode auto, CPU tensors of one dtype, fp32 or fp64, its library built (now, on first use); else None,
    and the caller computes the PyTorch form (megabam/model/layers.py, positional.py), as on CUDA, where torch's own
    kernels are fast, in mode reference or triton (there is no Triton kernel for these), and inside a
    graph that torch.compile traces (train.compile: inductor fuses the PyTorch form). Logged once per
    op, mode and choice like the others (not from inside a graph)."""
    if torch.compiler.is_compiling():
        return None
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

    cuda_choice = lambda: cuda_attention_choice(q, k, options)  # noqa: E731
    if key_cap_reached(q, options):  # only the C and Triton kernels and the tiled op apply the cap
        sdpa_applies = False  # c_tiles_apply reads it too: the C kernel then takes the call at any vector width
        cuda_choice = lambda: ("triton", "an SSMax key cap is reached: the kernel applies it")  # noqa: E731
    choice = choose(backend, q, sdpa_applies=sdpa_applies, c_tiles_apply=c_tiles_apply, cuda_choice=cuda_choice)
    if choice == "c_tiles":
        op = importlib.import_module(C_TILES).bam_attention_cpu
    elif choice == "triton":
        op = triton_kernel("attention")
    elif choice == "sdpa_cuda":
        op = bam_attention_torch.bam_attention_sdpa_causal
    elif choice == "flex":
        op = bam_attention_torch.bam_attention_flex
    elif choice == "sdpa":
        op = bam_attention_sdpa.bam_attention_sdpa
        # Its memory does not grow with the query block (the masks are views, the tiles its own), and
        # each fused call costs a fixed ~0.3 ms: below SDPA_MIN_BLOCK rows per call the calls cost more
        # than the masked work a larger diagonal block adds (docs/log/benchmarks-history.md, "CPU training speed").
        options = replace(options, block_size=max(options.block_size, SDPA_MIN_BLOCK))
    else:
        op = bam_attention
    # A profiler range named for the op: a profile counts its kernels, and its backward's through
    # autograd's link to the forward, as attention (tools/bench_gpu_train.py's split of a step by op).
    with record_function("megabam.attention_op"):
        return op(q, k, v, options)


def key_cap_reached(q: Tensor, options: AttentionOptions) -> bool:
    """Whether some row of this call may count more keys than a head's SSMax key cap: rows count at
    most N keys, so calls no longer than the smallest cap (every training call, the cap being at
    least data.seq_len) take any op, the cap changing nothing there."""
    return options.ssmax_key_cap is not None and q.shape[-2] > float(options.ssmax_key_cap.min())


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
    choice = choose(backend, q, "mlstm", cuda_choice=cuda_mlstm_choice)
    if choice == "tfla":
        op = mlstm_tfla.mlstm_chunkwise_tfla
    elif choice == "triton":
        op = triton_kernel("mlstm")
    else:
        op = mlstm_chunkwise_reference
        q, k, v = (t.to(compute_dtype(q)) for t in (q, k, v))
    with record_function("megabam.mlstm_cell"):  # a profiler range, as attention's
        return op(q, k, v, i, f, eps, chunk_size, state)


def mlstm_steps(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    i: Tensor,
    f: Tensor,
    eps: float,
    state: MLstmState | None = None,
    *,
    backend: str = "auto",
) -> tuple[Tensor, MLstmState]:
    """The mLSTM one step at a time (generation; arguments and result of kernels/mlstm.py::mlstm_recurrent):
    TFLA's step kernel on CUDA in mode auto where TFLA runs, else the PyTorch form (megabam has no
    step kernel of its own), in the compute dtype."""
    q, k, v = (t.to(compute_dtype(q)) for t in (q, k, v))
    mode = mode_of(backend)
    tfla = mode == "auto" and on_cuda(q) and cuda_mlstm_choice()[0] == "tfla"
    log_choice("mlstm_step", mode, "tfla" if tfla else "reference", q)
    if not tfla:
        return mlstm_recurrent(q, k, v, i, f, eps, state)
    B, H, N, dqk = q.shape
    if state is None:
        state = initial_mlstm_state(B, H, dqk, v.shape[-1], q.dtype, q.device)
    out = []
    for t in range(N):
        h, state = mlstm_tfla.mlstm_step_tfla(
            q[..., t, :], k[..., t, :], v[..., t, :], i[..., t], f[..., t], eps, state
        )
        out.append(h)
    return torch.stack(out, dim=-2), state


def gated_delta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int,
    state: Tensor | None = None,
    *,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """The Gated DeltaNet cell (arguments and result of kernels/gated_deltanet.py, q, k L2-normalised)
    on the op `choose` picks: fla's kernels (mode triton or, on CUDA, auto) take q, k, v in the
    model's dtype, the reference the compute dtype; g, β arrive in the compute dtype. One step
    (generation) runs the recurrent form, several the chunkwise one."""
    one_step = q.shape[-2] == 1
    if choose(backend, q, "gated_deltanet", cuda_choice=cuda_gated_delta_choice) in ("fla", "triton"):
        # fla's recurrent kernel has no backward: a step that needs gradients takes the chunk kernel.
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
        if one_step and not needs_grad:
            return gated_deltanet_fla.gated_delta_recurrent_fla(q, k, v, g, beta, state)
        with record_function("megabam.gated_deltanet_cell"):  # a profiler range, as attention's
            return gated_deltanet_fla.gated_delta_chunkwise_fla(q, k, v, g, beta, state)
    q, k, v = (t.to(compute_dtype(q)) for t in (q, k, v))
    if one_step:
        return gated_delta_recurrent(q, k, v, g, beta, state)
    with record_function("megabam.gated_deltanet_cell"):
        return gated_delta_chunkwise(q, k, v, g, beta, chunk_size, state)
