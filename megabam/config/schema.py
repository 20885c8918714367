"""The typed configuration of a megabam run.

Every field carries its meaning in `doc`; `megabam train --help-config` prints them. The YAML files
in yaml_configs/ set these fields; `load_config` checks types and unknown keys, then each section's
`check` (rules about its own fields, written beside them) and the cross-section rules of the loader.
A `check` reports a failure through `require(ok, dotted key, message)`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Require = Callable[[bool, str, str], None]

# The layer types a model can mix, one config section each, and the capital that stands for each in
# a compact pattern (layer_pattern: [SM] = [swa, mlstm]). The model registers a builder per name
# (megabam/model/registry.py).
MIXER_LETTERS = {"A": "attention", "S": "swa", "M": "mlstm", "G": "gated_deltanet"}
MIXER_NAMES = tuple(MIXER_LETTERS.values())


def is_compact_pattern(entry: str) -> bool:
    return entry != "" and all(ch in MIXER_LETTERS for ch in entry)


def expand_pattern(layer_pattern: list[str]) -> list[str]:
    """Mixer names of one period of the pattern; compact entries ("SM") expand to one name per letter."""
    names: list[str] = []
    for entry in layer_pattern:
        names += [MIXER_LETTERS[ch] for ch in entry] if is_compact_pattern(entry) else [entry]
    return names


def positive(require: Require, key: str, value: float) -> None:
    require(math.isfinite(value) and value > 0, key, f"must be a finite positive number, got {value}")


# Bounds far beyond any model trained, so a typo (10⁹, 2·10⁹) is refused in one line instead of asking
# for terabytes (seen: a 2·10⁹ vocabulary tried to allocate 524 TB).
MAX_TOKENS = 2**24  # a sequence, a vocabulary
MAX_SEED = 2**32 - 1  # numpy's seeds: 0..2³²−1


def at_most(require: Require, key: str, value: int, most: int, what: str) -> None:
    require(value <= most, key, f"must be at most {most:,} ({what}), got {value:,}")


def at_least_one(require: Require, pairs: list[tuple[str, int]]) -> None:
    for key, value in pairs:
        require(value >= 1, key, f"must be at least 1, got {value}")


def doc(default, text: str, **kw):
    """A dataclass field whose description travels with it (shown by --help-config)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": text}, **kw)
    if isinstance(default, type):
        return field(default_factory=default, metadata={"doc": text}, **kw)
    return field(default=default, metadata={"doc": text}, **kw)


@dataclass
class RunConfig:
    name: str = doc("run", "Run name; the run directory is output_dir/name.")
    output_dir: str = doc("runs", "Directory that holds run directories.")
    seed: int = doc(1234, "Seed of model initialisation and data shuffling.")

    def check(self, require: Require, key: str) -> None:
        require(0 <= self.seed <= MAX_SEED, f"{key}.seed", f"must lie in 0..{MAX_SEED}, got {self.seed}")
        plain = self.name not in ("", ".", "..") and "/" not in self.name and os.sep not in self.name
        # Control characters (a newline, NUL) break log lines, shells and the OS; 255 bytes is a file
        # name's limit, and the run's lock file adds 6.
        plain = plain and self.name.isprintable() and len(self.name.encode()) <= 240
        require(plain, f"{key}.name", f"must be a plain directory name (printable, ≤ 240 bytes), got {self.name!r}")


@dataclass
class BamConfig:
    init: Literal["alibi", "nope", "spread", "mixed"] = doc(
        "alibi",
        "Initial prior per head: alibi (θ_β=1, θ_α=log ALiBi slope), nope (θ_α=0, θ_β=0), "
        "spread (θ_β evenly over beta_range, θ_α=log slope), mixed (ALiBi-like heads, then flat heads).",
    )
    beta_range: list[float] = doc([-0.5, 1.0], "[lowest, highest] θ_β across heads for init=spread.")
    flat_fraction: float = doc(0.5, "Share of heads initialised flat (θ_α=0, θ_β=0) for init=mixed.")
    shared_across_layers: bool = doc(False, "One set of prior parameters for all layers instead of one per layer.")
    learn_mu: bool = doc(False, "Train θ_μ (the prior's centre μ=2·sinh θ_μ); frozen at μ=0 otherwise.")

    def check(self, require: Require, key: str) -> None:
        lo_hi = self.beta_range
        require(
            len(lo_hi) == 2 and lo_hi[0] <= lo_hi[1], f"{key}.beta_range", f"must be [lowest, highest], got {lo_hi}"
        )
        require(
            0.0 <= self.flat_fraction <= 1.0, f"{key}.flat_fraction", f"must lie in [0, 1], got {self.flat_fraction}"
        )


@dataclass
class AttentionConfig:
    positional: Literal["ggd_bam", "alibi", "nope", "rope", "sinusoidal"] = doc(
        "ggd_bam", "Positional scheme: GGD-BAM prior, ALiBi, NoPE, RoPE or sinusoidal embeddings."
    )
    bam: BamConfig = doc(BamConfig, "GGD-BAM prior settings (used when positional=ggd_bam).")
    ssmax: bool = doc(True, "Scalable softmax: logits of row i times s_h·log(n_i), s_h learnable per head.")
    ssmax_init: float = doc(
        1.0, "Initial s_h of every head; 1/ln(data.seq_len) makes SSMax plain softmax at the training length."
    )
    ssmax_before_prior: bool = doc(
        False, "Scale q·k by s_h·log(n_i) before adding the prior (default: scale after adding it)."
    )
    ssmax_key_cap: int | Literal["seq_len"] | None = doc(
        None,
        "SSMax's key count n_i stops at this many keys in heads whose prior decays with distance (θ_β > 0, "
        "ALiBi's too), as it stops at the window under a sliding window: such a head reads a neighbourhood, "
        "and past the training length log n_i would only sharpen it beyond anything it trained on. At least "
        "data.seq_len, so training never reaches it; seq_len = data.seq_len (resolved when the config is "
        "loaded); null = no cap. No effect without ssmax or without a prior.",
    )
    window: int | None = doc(None, "Sliding window in tokens (the token itself included); null = full causal.")
    document_aware: bool = doc(
        True, "Mask attention across packed-document boundaries and count SSMax n_i from the document start."
    )
    rope_theta: float = doc(10000.0, "RoPE base (positional=rope).")
    block_size: int = doc(
        128,
        "Query rows per tile of the tiled reference attention op (model.kernels=reference); its memory "
        "grows as block_size·N. The C kernel on CPU and the Triton kernel use their own tiles; torch's "
        "fused op, the CPU fallback, takes at least 256 rows per call.",
    )
    kv_heads: int | None = doc(
        None,
        "Key/value heads (grouped-query attention): each serves model.n_heads / kv_heads consecutive "
        "query heads, whose prior and SSMax stay their own; null = model.n_heads.",
    )


@dataclass
class SlidingWindowConfig(AttentionConfig):
    """Sliding-window attention layers (mixer `swa`): the attention settings with SWAX defaults."""

    positional: Literal["ggd_bam", "alibi", "nope", "rope", "sinusoidal"] = doc(
        "rope", "Positional scheme of the SWA layers (the SWAX paper uses RoPE); any of the attention schemes."
    )
    ssmax: bool = doc(False, "Scalable softmax in the SWA layers (off in the SWAX paper).")
    window: int | None = doc(
        None,
        "Window in tokens (the token itself included: key j is seen by query i iff i - window < j <= i) "
        "used when the call gives none (evaluation, inference); training steps take theirs from `window.*`. "
        "null = the run's final training window (window.anneal_window, else the largest of window.windows); "
        "given, it must equal that.",
    )


@dataclass
class MLstmConfig:
    n_heads: int | None = doc(None, "mLSTM heads; null = model.n_heads. Must divide d_model and the q, k width.")
    chunk_size: int = doc(64, "Time steps per chunk of the chunkwise (training) form; cost grows as N·chunk_size.")
    gate_soft_cap: float = doc(15.0, "Input/forget gate pre-activations are soft-capped to cap·tanh(x/cap).")
    eps: float = doc(1e-6, "Added to the denominator max(|q·n|, exp(-m)) of the cell output.")
    head_norm: Literal["rms", "layer"] = doc(
        "rms", "Per-head norm of the cell output: RMS norm, or mean-centred layer norm (xLSTM-7B's)."
    )
    qk_dim_factor: float = doc(0.5, "Width of q and k as a fraction of model.d_model (xLSTM-7B's 0.5; v is d_model).")
    conv_size: int = doc(
        4,
        "Kernel length of a short causal depthwise convolution, SiLU after, on q and k (the original xLSTM "
        "block's and Gated DeltaNet's); 0 = none (xLSTM-7B's). Without it a 2-layer mLSTM did not learn "
        "MQAR at d 64 (docs/results.md).",
    )
    igate_bias_init: float = doc(
        0.0,
        "Initial input-gate bias of every head (xLSTM-7B's -10 scales the layer's output and its gradient by "
        "~e^-10 at first; on MQAR with the convolution, 0 solved 4 pairs by step 600 where -10 reached 0.92 "
        "at 3,000: docs/results.md).",
    )
    fgate_bias_init: list[float] = doc(
        [3.0, 6.0],
        "[first head, last head] initial forget-gate biases, spread linearly (σ near 1: long memory at init).",
    )

    def check(self, require: Require, key: str) -> None:
        require(self.chunk_size >= 1, f"{key}.chunk_size", f"must be at least 1, got {self.chunk_size}")
        require(self.gate_soft_cap > 0, f"{key}.gate_soft_cap", f"must be positive, got {self.gate_soft_cap}")
        require(self.eps >= 0, f"{key}.eps", f"must be non-negative, got {self.eps}")
        require(self.conv_size >= 0, f"{key}.conv_size", f"must be 0 (none) or more, got {self.conv_size}")
        require(
            len(self.fgate_bias_init) == 2,
            f"{key}.fgate_bias_init",
            f"must be [first, last], got {self.fgate_bias_init}",
        )


@dataclass
class GatedDeltaNetConfig:
    n_heads: int | None = doc(None, "Gated DeltaNet heads; null = model.n_heads. Must divide model.d_model.")
    conv_size: int = doc(4, "Kernel length of the short causal depthwise convolutions on q, k and v.")
    chunk_size: int = doc(64, "Time steps per chunk of the chunkwise (training) form.")

    def check(self, require: Require, key: str) -> None:
        require(self.conv_size >= 1, f"{key}.conv_size", f"must be at least 1, got {self.conv_size}")
        require(self.chunk_size >= 1, f"{key}.chunk_size", f"must be at least 1, got {self.chunk_size}")


@dataclass
class ModelConfig:
    vocab_size: int = doc(4096, "Vocabulary size; the tokenizer is trained to exactly this size.")
    d_model: int = doc(128, "Residual stream width.")
    n_layers: int = doc(4, "Number of blocks.")
    n_heads: int = doc(4, "Attention heads per layer; must divide d_model.")
    ffn_hidden: int | None = doc(None, "SwiGLU hidden width; null = 8/3·d_model rounded up to a multiple of 64.")
    layer_pattern: list[str] = doc(
        ["attention"],
        "Mixer of each layer (attention, swa, mlstm, gated_deltanet), repeated cyclically over n_layers (n_layers "
        "must be a multiple); an entry of capitals is a compact pattern, one letter a layer: A, S, M, G (e.g. [SM]).",
    )
    tie_embeddings: bool = doc(True, "Share the input embedding and the output projection.")
    norm_eps: float = doc(1e-5, "RMSNorm epsilon.")
    logit_soft_cap: float | None = doc(
        None,
        "Output logits soft-capped to cap·tanh(z/cap) (xLSTM-7B: 30); null = none. A capped model's loss "
        "computes its logits whole rather than in the fused chunks of linear_cross_entropy.",
    )
    init_std: float = doc(0.02, "Standard deviation of weight initialisation.")
    attention: AttentionConfig = doc(AttentionConfig, "Full attention mixer (`attention`) settings.")
    swa: SlidingWindowConfig = doc(SlidingWindowConfig, "Sliding-window attention mixer (`swa`) settings.")
    mlstm: MLstmConfig = doc(MLstmConfig, "mLSTM mixer (`mlstm`) settings.")
    gated_deltanet: GatedDeltaNetConfig = doc(GatedDeltaNetConfig, "Gated DeltaNet mixer (`gated_deltanet`) settings.")
    kernels: Literal["auto", "triton", "reference"] = doc(
        "auto",
        "Attention and chunkwise mLSTM ops: auto = Triton kernels on CUDA tensors; on CPU torch's fused attention "
        "for attention without a prior, the tiled op with C passes (built at first use) with one, and RMS norms, "
        "the SwiGLU product and RoPE in one C pass each, else the PyTorch references; triton or reference forces "
        "one (reference: PyTorch everywhere) "
        "(env MEGABAM_KERNELS overrides; triton on CPU only under TRITON_INTERPRET=1).",
    )

    def ffn_hidden_size(self) -> int:
        """ffn_hidden, or 8/3·d_model (the parameter count of a 4·d GELU MLP) rounded up to a multiple of 64."""
        return self.ffn_hidden or -(-(8 * self.d_model // 3) // 64) * 64

    def layer_types(self) -> list[str]:
        """The mixer name of every layer: the expanded pattern repeated over n_layers."""
        period = expand_pattern(self.layer_pattern)
        return period * (self.n_layers // len(period))

    def sinusoidal_positions(self) -> bool:
        """Whether sinusoidal positions are added to the embeddings: an attention section the layers use
        (`attention`, `swa`) asks for them, and then they serve every layer."""
        used = set(self.layer_types())
        return any(
            getattr(self, section).positional == "sinusoidal" for section in ("attention", "swa") if section in used
        )

    def check(self, require: Require, key: str) -> None:
        """The model's own rules; the mixer sections are checked where the pattern uses them (the
        attention section always)."""
        require(
            self.logit_soft_cap is None or self.logit_soft_cap > 0,
            f"{key}.logit_soft_cap",
            f"must be positive or null, got {self.logit_soft_cap}",
        )
        at_least_one(
            require,
            [
                (f"{key}.vocab_size", self.vocab_size),
                (f"{key}.d_model", self.d_model),
                (f"{key}.n_layers", self.n_layers),
                (f"{key}.n_heads", self.n_heads),
                (f"{key}.attention.block_size", self.attention.block_size),
            ],
        )
        at_most(require, f"{key}.vocab_size", self.vocab_size, MAX_TOKENS, "pieces")
        positive(require, f"{key}.init_std", self.init_std)
        positive(require, f"{key}.norm_eps", self.norm_eps)
        for section in ("attention", "swa"):
            positive(require, f"{key}.{section}.rope_theta", getattr(self, section).rope_theta)
            # NaN or inf made every step non-finite: all skipped, and a short run ended 0, untrained.
            positive(require, f"{key}.{section}.ssmax_init", getattr(self, section).ssmax_init)
        require(
            self.d_model % self.n_heads == 0,
            f"{key}.n_heads",
            f"{self.n_heads} does not divide {key}.d_model={self.d_model}",
        )
        head_dim = self.d_model // self.n_heads
        require(
            self.attention.positional != "rope" or head_dim % 2 == 0,
            f"{key}.attention.positional",
            f"rope needs an even head dimension, got {head_dim}",
        )
        for section in ("attention", "swa"):
            kv = getattr(self, section).kv_heads
            require(
                kv is None or (kv >= 1 and self.n_heads % kv == 0),
                f"{key}.{section}.kv_heads",
                f"{kv} does not divide {key}.n_heads={self.n_heads}",
            )
        require(
            self.ffn_hidden is None or self.ffn_hidden >= 1,
            f"{key}.ffn_hidden",
            f"must be at least 1, got {self.ffn_hidden}",
        )
        require(len(self.layer_pattern) >= 1, f"{key}.layer_pattern", "must name at least one mixer")
        for i, name in enumerate(self.layer_pattern):
            require(
                name in MIXER_NAMES or is_compact_pattern(name),
                f"{key}.layer_pattern[{i}]",
                f"unknown mixer {name!r} (known: {', '.join(MIXER_NAMES)}, or letters of {''.join(MIXER_LETTERS)})",
            )
        period = expand_pattern(self.layer_pattern)
        require(
            self.n_layers % len(period) == 0,
            f"{key}.n_layers",
            f"{self.n_layers} is not a multiple of the layer_pattern length {len(period)}",
        )
        if "swa" in period:
            require(
                head_dim % 2 == 0 or self.swa.positional != "rope",
                f"{key}.swa.positional",
                f"rope needs an even head dimension, got {head_dim}",
            )
            require(self.swa.block_size >= 1, f"{key}.swa.block_size", f"must be at least 1, got {self.swa.block_size}")
        if "mlstm" in period:
            heads = self.mlstm.n_heads or self.n_heads
            qk = self.d_model * self.mlstm.qk_dim_factor
            require(
                qk >= 1 and qk == round(qk),
                f"{key}.mlstm.qk_dim_factor",
                f"{self.mlstm.qk_dim_factor} × {key}.d_model={self.d_model} is not a whole width",
            )
            require(
                heads >= 1 and round(qk) % heads == 0 and self.d_model % heads == 0,
                f"{key}.mlstm.n_heads",
                f"{heads} does not divide {key}.d_model and the q, k width {round(qk)}"
                f" ({key}.mlstm.qk_dim_factor={self.mlstm.qk_dim_factor})",
            )
            self.mlstm.check(require, f"{key}.mlstm")
        if "gated_deltanet" in period:
            heads = self.gated_deltanet.n_heads or self.n_heads
            require(
                heads >= 1 and self.d_model % heads == 0,
                f"{key}.gated_deltanet.n_heads",
                f"{heads} does not divide {key}.d_model={self.d_model}",
            )
            self.gated_deltanet.check(require, f"{key}.gated_deltanet")
        self.attention.bam.check(require, f"{key}.attention.bam")


@dataclass
class WindowConfig:
    """The per-step window of the sliding-window attention layers (megabam/train/window_sampler.py)."""

    windows: list[int] = doc([128, 2048], "Candidate windows in tokens; one is drawn for every optimizer step.")
    probabilities: list[float] = doc(
        [0.5, 0.5], "Probability of each window, in the order of `windows` (sums to 1); one window with 1.0 = fixed."
    )
    anneal_fraction: float = doc(0.1, "The last this share of the steps uses anneal_window only (no draw).")
    anneal_window: int | None = doc(None, "Window of the annealing steps; null = the largest of `windows`.")

    def final_window(self) -> int:
        """The window of the last training steps: anneal_window, else the largest drawn; the SWA layers'
        inference window (model.swa.window) unless given."""
        return self.anneal_window if self.anneal_window is not None else max(self.windows)

    def check(self, require: Require, key: str) -> None:
        """Checked whatever the pattern; the bounds by data.seq_len, with sliding-window layers, are the loader's."""
        require(len(self.windows) >= 1, f"{key}.windows", "must list at least one window")
        require(
            len(self.probabilities) == len(self.windows),
            f"{key}.probabilities",
            f"needs one probability per window ({len(self.windows)}), got {len(self.probabilities)}",
        )
        for i, p in enumerate(self.probabilities):
            require(0.0 <= p <= 1.0, f"{key}.probabilities[{i}]", f"must lie in [0, 1], got {p}")
        require(
            abs(sum(self.probabilities) - 1.0) < 1e-6,
            f"{key}.probabilities",
            f"must sum to 1, got {sum(self.probabilities)}",
        )
        require(
            0.0 <= self.anneal_fraction <= 1.0,
            f"{key}.anneal_fraction",
            f"must lie in [0, 1], got {self.anneal_fraction}",
        )


@dataclass
class ParallelConfig:
    data: int = doc(
        0,
        "Data-parallel size; 0 = whatever the launched world leaves (world ÷ tensor·pipeline). Set, a launch "
        "whose world size is not data·tensor·pipeline is refused at start.",
    )
    tensor: int = doc(1, "Tensor-parallel size.")
    pipeline: int = doc(
        1,
        "Pipeline-parallel size: DeepSpeed's pipeline engine (1F1B) over train.grad_accum micro-batches "
        "per step; needs zero_stage 1.",
    )
    pipeline_boundaries: list[int] = doc(
        [],
        "First layer index of each pipeline stage after the first (pipeline − 1 increasing indices); "
        "empty = stages balanced by parameter count. The embedding joins the first stage, the final norm and "
        "head the last.",
    )
    sequence_parallel: bool = doc(
        False,
        "Megatron sequence parallelism on top of tensor parallelism: norms and residuals hold "
        "sequence shards (N/tensor tokens per rank); needs tensor > 1 and sequence lengths divisible by tensor.",
    )
    zero_stage: int = doc(1, "DeepSpeed ZeRO stage (0, 1, 2) over the data-parallel group.")
    recompute: Literal["none", "selective", "full"] = doc(
        "none", "Activation recomputation: none; selective = the mixers named in recompute_mixers; full = every block."
    )
    recompute_mixers: list[str] = doc(
        ["attention", "swa", "mlstm", "gated_deltanet"], "Mixer types recomputed when recompute=selective."
    )

    def check(self, require: Require, key: str) -> None:
        at_least_one(require, [(f"{key}.tensor", self.tensor), (f"{key}.pipeline", self.pipeline)])
        require(self.data >= 0, f"{key}.data", f"must be 0 (from the world size) or a size, got {self.data}")
        require(self.zero_stage in (0, 1, 2), f"{key}.zero_stage", f"must be 0, 1 or 2, got {self.zero_stage}")
        require(
            not self.pipeline_boundaries or self.pipeline > 1,
            f"{key}.pipeline_boundaries",
            "given but parallel.pipeline is 1",
        )
        for i, name in enumerate(self.recompute_mixers):
            require(
                name in MIXER_NAMES,
                f"{key}.recompute_mixers[{i}]",
                f"unknown mixer {name!r} (known: {', '.join(MIXER_NAMES)})",
            )


@dataclass
class StreamConfig:
    path: str = doc("", "A prepared dataset directory (train/, val/), or the local cache of `remote`.")
    remote: str | None = doc(
        None, "Where the dataset lives when not local (s3://, gs://, ... or a directory); null = path only."
    )
    weight: float | None = doc(None, "Relative share of training samples (set on every stream or on none).")
    repeat: float | None = doc(None, "Instead of a weight: times each sample is drawn per epoch (fractions subsample).")


@dataclass
class DataConfig:
    source: Literal["default", "mds"] = doc(
        "default",
        "default = Python's stdlib sources + synthetic passkey samples, built offline and cached; "
        "mds = datasets written by `megabam data prepare` / `synth`, listed in data.streams.",
    )
    streams: list[StreamConfig] = doc(
        [], "data.source=mds: the prepared datasets to mix (path, remote, weight or repeat)."
    )
    tokenizer: str | None = doc(
        None,
        "data.source=mds: the tokenizer the streams were tokenized with (a sentencepiece .model, a tokenizer.json "
        "or a save_pretrained folder).",
    )
    verify_hashes: bool = doc(
        False,
        "data.source=mds: check every local shard's sha1 before training (reads all data once; "
        "sizes are always checked, remote shards are hashed by streaming when downloaded).",
    )
    seq_len: int = doc(256, "Tokens per training sequence.")
    corpus_bytes: int = doc(4_000_000, "Bytes of stdlib source text in the default corpus.")
    passkey_fraction: float = doc(0.25, "Share of training samples that are passkey-retrieval documents.")
    passkey_min_tokens: int | None = doc(
        None,
        "Shortest passkey document: each passkey sample then holds several, of random lengths from this to "
        "data.seq_len (more retrievals per token, at every distance); null = one document per sample.",
    )
    passkey_filler: Literal["fixed", "varied"] = doc(
        "fixed",
        "Filler of the training passkey documents: fixed = the evaluation's five sentences; varied = one to "
        "five of them in random order per document (each filler token recurs more often, as in long prompts).",
    )
    passkey_key_digits: list[int] = doc(
        [5, 5],
        "Digits of the training passkey documents' keys, [fewest, most], drawn per document (the evaluation's "
        "keys have 5); varied lengths leave the model no way to end the answer but copying the needle.",
    )
    passkey_answer_end: Literal["eos", "period"] = doc(
        "eos",
        "What follows the key in a training passkey document's answer: eos = its eos, right after the last "
        "digit; period = a period, then the eos, as the needle writes the key ('{key}. Remember it.').",
    )
    val_fraction: float = doc(0.02, "Share of samples held out for validation.")
    cache_dir: str | None = doc(None, "Where built datasets are cached; null = $MEGABAM_CACHE or ~/.cache/megabam.")
    num_workers: int = doc(0, "DataLoader worker processes.")

    def check(self, require: Require, key: str) -> None:
        at_least_one(require, [(f"{key}.seq_len", self.seq_len), (f"{key}.corpus_bytes", self.corpus_bytes)])
        at_most(require, f"{key}.seq_len", self.seq_len, MAX_TOKENS, "tokens per sequence")
        require(
            0 <= self.passkey_fraction < 1,
            f"{key}.passkey_fraction",
            f"must lie in [0, 1), got {self.passkey_fraction}",
        )
        require(0 < self.val_fraction < 1, f"{key}.val_fraction", f"must lie in (0, 1), got {self.val_fraction}")
        if self.passkey_min_tokens is not None:
            require(
                1 <= self.passkey_min_tokens <= self.seq_len,
                f"{key}.passkey_min_tokens",
                f"must lie in 1..data.seq_len={self.seq_len}, got {self.passkey_min_tokens}",
            )
        digits = self.passkey_key_digits
        require(
            len(digits) == 2 and 1 <= digits[0] <= digits[1] <= 18,
            f"{key}.passkey_key_digits",
            f"must be [fewest, most] digits within 1..18, got {digits}",
        )
        require(self.num_workers >= 0, f"{key}.num_workers", f"must be non-negative, got {self.num_workers}")
        if self.source != "mds":
            require(not self.streams, f"{key}.streams", "only used with data.source: mds")
            return
        # data.source=mds needs streams and a tokenizer; weights positive, on every stream or none.
        require(len(self.streams) >= 1, f"{key}.streams", "data.source mds needs at least one stream")
        require(bool(self.tokenizer), f"{key}.tokenizer", "data.source mds needs the tokenizer of its streams")
        weighted = [s.weight is not None for s in self.streams]
        for i, s in enumerate(self.streams):
            at = f"{key}.streams[{i}]"
            require(s.path != "", f"{at}.path", "must name the dataset directory (or local cache)")
            require(s.weight is None or s.weight > 0, f"{at}.weight", f"must be positive, got {s.weight}")
            require(s.repeat is None or s.repeat > 0, f"{at}.repeat", f"must be positive, got {s.repeat}")
            require(s.weight is None or s.repeat is None, at, "give a weight or a repeat, not both")
            require(weighted[i] or not any(weighted), f"{at}.weight", "set a weight on every stream or on none")


@dataclass
class OptimConfig:
    kind: Literal["adamw", "radam"] = doc(
        "adamw",
        "adamw, or radam (the BAM reference's: Adam whose variance estimate warms itself up, so it is run "
        "with schedule.warmup_steps=0; weight decay decoupled as in AdamW).",
    )
    lr: float = doc(3e-3, "Peak learning rate.")
    weight_decay: float = doc(0.1, "Decoupled weight decay (never on norms, biases, prior parameters or SSMax s).")
    betas: list[float] = doc([0.9, 0.95], "Adam betas.")
    eps: float = doc(1e-8, "Adam epsilon.")
    prior_lr_mult: float = doc(1.0, "Learning-rate multiplier of the BAM prior parameters θ.")
    ssmax_lr_mult: float = doc(1.0, "Learning-rate multiplier of the SSMax s parameters.")
    grad_clip: float = doc(1.0, "Clip the global gradient norm to this value; 0 = off.")

    def check(self, require: Require, key: str) -> None:
        positive(require, f"{key}.lr", self.lr)
        positive(require, f"{key}.eps", self.eps)
        require(self.weight_decay >= 0, f"{key}.weight_decay", f"must be non-negative, got {self.weight_decay}")
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"{key}.betas",
            f"must be two values in [0, 1), got {self.betas}",
        )
        require(self.prior_lr_mult >= 0, f"{key}.prior_lr_mult", f"must be non-negative, got {self.prior_lr_mult}")
        require(self.ssmax_lr_mult >= 0, f"{key}.ssmax_lr_mult", f"must be non-negative, got {self.ssmax_lr_mult}")
        require(
            math.isfinite(self.grad_clip) and self.grad_clip >= 0,
            f"{key}.grad_clip",
            f"must be a finite non-negative number (0 = off), got {self.grad_clip}",
        )


@dataclass
class ScheduleConfig:
    kind: Literal["cosine", "wsd", "constant"] = doc(
        "cosine",
        "cosine: warmup then cosine decay; wsd: warmup, stable, then linear decay; constant: warmup then flat.",
    )
    warmup_steps: int = doc(20, "Linear warmup steps.")
    min_lr_ratio: float = doc(0.1, "Final learning rate as a fraction of the peak.")
    decay_fraction: float = doc(0.2, "wsd: share of the steps spent decaying at the end.")

    def check(self, require: Require, key: str) -> None:
        require(0 <= self.min_lr_ratio <= 1, f"{key}.min_lr_ratio", f"must lie in [0, 1], got {self.min_lr_ratio}")
        require(0 < self.decay_fraction <= 1, f"{key}.decay_fraction", f"must lie in (0, 1], got {self.decay_fraction}")


@dataclass
class TrainConfig:
    steps: int = doc(300, "Optimizer steps.")
    micro_batch_size: int = doc(8, "Sequences per micro-batch per data-parallel rank.")
    grad_accum: int = doc(1, "Micro-batches accumulated per optimizer step.")
    precision: Literal["fp32", "bf16"] = doc("fp32", "Training precision (bf16 keeps fp32 master weights).")
    compile: Literal["off", "blocks"] = doc(
        "off",
        "torch.compile: off; blocks = each decoder block compiled on its own (torchtitan's regional compile), "
        "the attention and mLSTM kernels left outside the graphs.",
    )
    eval_every: int = doc(0, "Validation every this many steps (0 = only at the end).")
    eval_batches: int = doc(
        8,
        "Validation micro-batches per evaluation; 0 = no validation (the run reads no validation split). A "
        "validation split smaller than one micro-batch per data-parallel rank is refused at start.",
    )
    max_bad_steps: int = doc(
        5,
        "Stop after this many consecutive steps whose loss or gradient norm is not finite (each is skipped); "
        "0 = never stop.",
    )
    init_from: str | None = doc(
        None,
        "A consolidated folder (megabam convert consolidate / from-hf) whose weights start a new run; the "
        "optimizer, schedule and data start fresh. Ignored when the run resumes from its own checkpoint.",
    )

    def check(self, require: Require, key: str) -> None:
        at_least_one(
            require,
            [
                (f"{key}.steps", self.steps),
                (f"{key}.micro_batch_size", self.micro_batch_size),
                (f"{key}.grad_accum", self.grad_accum),
            ],
        )
        require(self.eval_every >= 0, f"{key}.eval_every", f"must be non-negative, got {self.eval_every}")
        require(self.eval_batches >= 0, f"{key}.eval_batches", f"must be non-negative, got {self.eval_batches}")
        require(self.max_bad_steps >= 0, f"{key}.max_bad_steps", f"must be non-negative, got {self.max_bad_steps}")


@dataclass
class EvalConfig:
    passkey_samples: int = doc(16, "Passkey prompts scored per length at the end of training (0 = off).")
    passkey_lengths: list[int] = doc(
        [], "Passkey prompt lengths in tokens; empty = data.seq_len. Longer = extrapolation."
    )

    def check(self, require: Require, key: str) -> None:
        require(
            self.passkey_samples >= 0, f"{key}.passkey_samples", f"must be non-negative, got {self.passkey_samples}"
        )
        for i, n in enumerate(self.passkey_lengths):
            require(n >= 1, f"{key}.passkey_lengths[{i}]", f"must be at least 1, got {n}")


@dataclass
class CheckpointConfig:
    every: int = doc(100, "Save a checkpoint every this many steps (and always at the end); 0 = only at the end.")
    keep: int = doc(3, "Keep the newest this many checkpoints; older ones are deleted after a save.")

    def check(self, require: Require, key: str) -> None:
        require(self.keep >= 1, f"{key}.keep", f"must be at least 1, got {self.keep}")
        require(self.every >= 0, f"{key}.every", f"must be non-negative, got {self.every}")


@dataclass
class LoggingConfig:
    log_every: int = doc(10, "Log metrics every this many steps.")
    progress_bar: bool = doc(True, "Show a progress bar on rank 0.")
    wandb_mode: Literal["offline", "online", "disabled"] = doc(
        "offline", "wandb mode; offline needs no account; online only when you configure it."
    )
    wandb_project: str = doc("megabam", "wandb project name.")
    wandb_entity: str | None = doc(None, "wandb entity (user or team) the run belongs to; null = your default.")
    wandb_group: str | None = doc(None, "wandb group, to gather related runs (a sweep, the ranks of a comparison).")
    wandb_tags: list[str] = doc([], "wandb tags, 1 to 64 characters each.")
    wandb_name: str | None = doc(None, "wandb run name; null = run.name.")
    tensorboard: bool = doc(
        False,
        "Write TensorBoard events under RUN/tensorboard/ (rank 0): the metrics.jsonl scalars, each head's "
        "values charted per layer (Custom Scalars), the figures as images.",
    )
    peak_tflops: float | None = doc(
        None, "Peak TFLOP/s of one device for the MFU estimate; null = known GPUs only, no MFU elsewhere."
    )
    plots: bool = doc(
        True,
        "Draw loss.png and passkey.png at the end of training (rank 0, matplotlib: ~0.4 s); the scores "
        "are logged either way.",
    )
    track_memory: bool = doc(
        False,
        "CPU: measure the peak of allocated tensors during step 2 (torch's MemTracker; slows that step) and log it "
        "beside the planner's prediction. On CUDA the allocator's peak is logged always.",
    )

    def check(self, require: Require, key: str) -> None:
        require(self.log_every >= 1, f"{key}.log_every", f"must be at least 1, got {self.log_every}")
        require(
            self.peak_tflops is None or self.peak_tflops > 0,
            f"{key}.peak_tflops",
            f"must be positive, got {self.peak_tflops}",
        )
        for i, tag in enumerate(self.wandb_tags):  # wandb.init's rule, checked before any work rather than at its start
            require(1 <= len(tag) <= 64, f"{key}.wandb_tags[{i}]", f"must be 1 to 64 characters, got {tag!r}")


@dataclass
class Config:
    run: RunConfig = doc(RunConfig, "Run identity.")
    model: ModelConfig = doc(ModelConfig, "Model shape and mixers.")
    window: WindowConfig = doc(
        WindowConfig, "Per-step window of the sliding-window attention layers (used when the pattern has `swa`)."
    )
    parallel: ParallelConfig = doc(ParallelConfig, "Parallel layout.")
    data: DataConfig = doc(DataConfig, "Training data.")
    optim: OptimConfig = doc(OptimConfig, "Optimizer.")
    schedule: ScheduleConfig = doc(ScheduleConfig, "Learning-rate schedule.")
    train: TrainConfig = doc(TrainConfig, "Training loop.")
    eval: EvalConfig = doc(EvalConfig, "Evaluation at the end of training.")
    checkpoint: CheckpointConfig = doc(CheckpointConfig, "Checkpointing.")
    logging: LoggingConfig = doc(LoggingConfig, "Logging.")
