"""Parameters and FLOPs per token by component, read off the model itself built on the meta device
(no memory, no initialisation), so that they are the trainer's model's exactly.

Components: `embedding`, `head` (the output projection; 0 parameters when tied), one per mixer type
(its projections, gates and norms), `bam_prior` (θ_α, θ_β, θ_μ), `ssmax` (s), `mlp`, `norms` (the
blocks' and the final RMSNorm). FLOPs: 2 per weight of every matrix (and convolution) per token
forward — the head's too when tied, the embedding's lookup none — plus each mixer's own sequence work
(`mixing_flops`, beside its code: attention with its causal window, the prior and SSMax, mLSTM and
Gated DeltaNet chunkwise within and between chunks). Training is 3 × forward (the backward pass does
twice the forward's matrix work); recomputation adds the recomputed parts' forward once more. Model
FLOPs (for MFU) count no recomputation, as Megatron's and PaLM's MFU do.

Causal masks are counted as run: a query meets the keys before it (half a sequence on average under
full attention). The MFU that Megatron-LM, PaLM and LLM Foundry publish counts every query against
every key of its sequence, masked or not; `causal=False` counts that way (masked triangles whole:
attention over min(window, n) keys, the recurrent cells over whole chunks), for comparing with them.
"""

import functools
import weakref

import torch

from megabam.config import Config
from megabam.model import Decoder

MIXER_PARTS = ("prior", "ssmax_s")  # inside a mixer, counted as components of their own


def meta_model(cfg: Config) -> Decoder:
    with torch.device("meta"):
        return Decoder(cfg.model)


def component(name: str, layer_types: list[str]) -> str:
    """The component a parameter name belongs to."""
    if name == "embed.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "head"
    if name == "norm.weight" or name.endswith(("mixer_norm.weight", "mlp_norm.weight")):
        return "norms"
    parts = name.split(".")
    if parts[2] == "mlp":
        return "mlp"
    if ".prior." in name:
        return "bam_prior"
    if parts[-1] == "ssmax_s":
        return "ssmax"
    return layer_types[int(parts[1])]


def params_by_component(model: Decoder) -> dict[str, int]:
    """Parameters per component; a module shared by several layers (one BAM prior for all) once."""
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():  # named_parameters yields a shared parameter once
        key = component(name, model.layer_types)
        counts[key] = counts.get(key, 0) + p.numel()
    return counts


def window_draws(cfg: Config) -> list[tuple[int | None, float]]:
    """The SWA windows a training step uses and how often: the window sampler's draws and its
    annealing share at the end (a pattern without SWA layers: the configured window, always)."""
    if "swa" not in cfg.model.layer_types():
        return [(None, 1.0)]
    w = cfg.window
    anneal = w.anneal_window or max(w.windows)
    draws = [(size, p * (1 - w.anneal_fraction)) for size, p in zip(w.windows, w.probabilities)]
    return draws + [(anneal, w.anneal_fraction)]


def per_model(fn):
    """fn(model) computed once per model object and kept while the model lives (weakly keyed, so the
    cache holds no model): the planner asks for hundreds of layouts of one model. For models whose
    parameters keep their shapes afterwards (a meta model; the trainer's, before it is sharded)."""
    cache = weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def cached(model: Decoder):
        if model not in cache:
            cache[model] = fn(model)
        return cache[model]

    return cached


@per_model
def matmul_flops(model: Decoder) -> tuple[tuple[str, float], ...]:
    """(component, forward FLOPs per token) of the weight matrices, the embedding lookup excluded."""
    flops: dict[str, float] = {}
    for name, p in model.named_parameters():
        if p.dim() >= 2 and name != "embed.weight":
            key = component(name, model.layer_types)
            flops[key] = flops.get(key, 0.0) + 2.0 * p.numel()
    if model.lm_head is None:  # tied: the embedding matrix is the head's matmul too
        flops["head"] = flops.get("head", 0.0) + 2.0 * model.embed.weight.numel()
    return tuple(flops.items())


def forward_flops_by_component(
    model: Decoder, seq_len: int, draws=((None, 1.0),), causal: bool = True
) -> dict[str, float]:
    """Forward FLOPs per token per component (mixing parts as `<mixer>.<part>`), SWA layers averaged
    over the window draws; `causal`: see the module docstring."""
    flops = dict(matmul_flops(model))

    def add(key: str, value: float) -> None:
        flops[key] = flops.get(key, 0.0) + value

    for kind, block in zip(model.layer_types, model.blocks):
        for window, share in draws:
            for part, value in block.mixer.mixing_flops(seq_len, window, causal).items():
                add(f"{kind}.{part}", share * value)
    return flops


def training_flops_per_token(cfg: Config, model: Decoder | None = None, causal: bool = True) -> dict[str, float]:
    """{"model": 3 × forward (what MFU divides by), "hardware": with the config's recomputation};
    `causal=False`: as published MFU counts (the module docstring)."""
    model = model or meta_model(cfg)
    forward = forward_flops_by_component(model, cfg.data.seq_len, window_draws(cfg), causal)
    total = sum(forward.values())
    recomputed = recompute_share(cfg.parallel.recompute, cfg.parallel.recompute_mixers, forward)
    return {"model": 3 * total, "hardware": 3 * total + recomputed}


def recompute_share(mode: str, mixers: list[str], forward: dict[str, float]) -> float:
    """Forward FLOPs per token run a second time by activation recomputation `mode` (selective:
    of the mixers named)."""
    if mode == "none":
        return 0.0
    blocks = {k: v for k, v in forward.items() if k not in ("embedding", "head")}
    if mode == "full":
        return sum(blocks.values())
    return sum(v for k, v in blocks.items() if k.split(".")[0] in set(mixers))
