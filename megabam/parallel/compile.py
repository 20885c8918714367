"""torch.compile of each decoder block, applied to a built `Decoder` (torchtitan's `apply_compile`).

Each block is compiled on its own, not the whole model: blocks of one type share their code, so
dynamo compiles it once for all of them, and the embedding, the output and the pipeline's cut stay
as they are. The forwards are compiled in place, so parameter names and checkpoints are the same
compiled or not.

The calls of the kernels (each mixer's `kernel_calls`: the attention op, the mLSTM and Gated DeltaNet
cells) run outside
the compiled graphs. They are fused kernels already (C, Triton, torch's SDPA, FlexAttention compiled
on its own), and their dispatch (kernels/dispatch.py) reads what dynamo cannot trace: the
environment, libraries built on first use, a log of its choices. The per-step window of the
sliding-window layers is read inside the attention call, so no graph depends on it: a new window
recompiles nothing (tests/unit/test_compile.py). Inside a graph the RMS norm, SwiGLU product and
rotary embedding take their PyTorch forms, which inductor fuses (dispatch.fused_cpu_op).

Those calls end a graph, and a region that torch.utils.checkpoint recomputes cannot be traced across
such an end; so the mixer's forward is compiled as well as the block's, and recomputation
(activation_checkpoint.py, applied after this) wraps the compiled forwards: `full` a compiled block,
`selective` a compiled mixer. Without recomputation the block's graph takes the mixer's code in.
"""

import torch
from torch import nn


def apply_compile(model: nn.Module, mode: str) -> None:
    """mode: off | blocks (train.compile)."""
    if mode == "off":
        return
    for block in model.blocks:
        for module in block.modules():
            for name in getattr(module, "kernel_calls", ()):
                setattr(module, name, torch.compiler.disable(getattr(module, name)))
        block.mixer.forward = torch.compile(block.mixer.forward)
        block.forward = torch.compile(block.forward)
