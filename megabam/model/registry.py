"""The mixer registry: each mixer module registers the builder of its layer type under the name the
config gives that type (megabam/config/schema.py MIXER_NAMES), so the config never imports the model.

A builder takes the model config and a dict of modules shared across layers (e.g. one BAM prior for
every layer) and returns an nn.Module called as mixer(x, SequenceInfo), with stream(x, state,
SequenceInfo) → (y, state) for recurrent inference, mixing_flops(seq_len, window, causal) → forward FLOPs
per token by part (megabam/plan: the planner and the trainer's MFU), and tp_plan() → TensorParallelPlan
for tensor parallelism.
"""

from collections.abc import Callable

from torch import nn

from megabam.config.schema import MIXER_NAMES, ModelConfig

MixerBuilder = Callable[[ModelConfig, dict], nn.Module]
MIXERS: dict[str, MixerBuilder] = {}


def register_mixer(name: str) -> Callable[[MixerBuilder], MixerBuilder]:
    if name not in MIXER_NAMES:
        raise ValueError(f"mixer {name!r} has no config section (known: {', '.join(MIXER_NAMES)})")

    def add(builder: MixerBuilder) -> MixerBuilder:
        MIXERS[name] = builder
        return builder

    return add
