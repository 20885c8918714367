"""Activation recomputation, applied to a built `Decoder` (torchtitan's `apply_ac`).

`full` recomputes every block in the backward pass (only block inputs are kept); `selective`
recomputes only the mixers of the named types (attention's tiles and the recurrent cells' chunk
states are the large activations), keeping the MLPs' activations. Non-reentrant checkpointing, so
tensor-parallel collectives inside a recomputed region simply run again, in the same order on
every rank, and the attention op's own autograd function is recomputed like any other op.

The wrapped `forward` is replaced on the instance, not by wrapping the module, so parameter names
and checkpoints are the same with and without recomputation.
"""

from torch import nn
from torch.utils.checkpoint import checkpoint

from megabam.config.schema import MIXER_NAMES


def _recomputed(forward):
    def run(*args):
        return checkpoint(forward, *args, use_reentrant=False)

    return run


def apply_ac(model: nn.Module, mode: str, mixer_types: list[str]) -> None:
    """mode: none | selective | full; in selective mode the mixers whose type (`model.layer_types`)
    is in `mixer_types` are recomputed."""
    if mode == "none":
        return
    unknown = set(mixer_types) - set(MIXER_NAMES)
    if unknown:
        raise ValueError(f"unknown mixer types {sorted(unknown)}")
    for block, kind in zip(model.blocks, model.layer_types):
        if mode == "full":
            block.forward = _recomputed(block.forward)
        elif kind in mixer_types:
            block.mixer.forward = _recomputed(block.mixer.forward)
