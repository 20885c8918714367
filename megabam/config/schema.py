"""The typed configuration of a megabam run.

Every field carries its meaning in `doc`; `megabam train --help-config` prints them. The YAML files
in yaml_configs/ set these fields; `load_config` checks types, unknown keys and cross-field rules.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


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


@dataclass
class AttentionConfig:
    positional: Literal["ggd_bam", "alibi", "nope", "rope", "sinusoidal"] = doc(
        "ggd_bam", "Positional scheme: GGD-BAM prior, ALiBi, NoPE, RoPE or sinusoidal embeddings."
    )
    bam: BamConfig = doc(BamConfig, "GGD-BAM prior settings (used when positional=ggd_bam).")
    ssmax: bool = doc(True, "Scalable softmax: logits of row i times s_h·log(n_i), s_h learnable per head.")
    ssmax_before_prior: bool = doc(
        False, "Scale q·k by s_h·log(n_i) before adding the prior (default: scale after adding it)."
    )
    window: Optional[int] = doc(None, "Sliding window in tokens (the token itself included); null = full causal.")
    document_aware: bool = doc(
        True, "Mask attention across packed-document boundaries and count SSMax n_i from the document start."
    )
    rope_theta: float = doc(10000.0, "RoPE base (positional=rope).")
    block_size: int = doc(128, "Query rows per tile of the attention op; memory grows as block_size·N.")
    kv_heads: Optional[int] = doc(
        None, "Key/value heads (grouped-query attention): each serves model.n_heads / kv_heads consecutive "
        "query heads, whose prior and SSMax stay their own; null = model.n_heads."
    )


@dataclass
class SlidingWindowConfig(AttentionConfig):
    """Sliding-window attention layers (mixer `swa`): the attention settings with SWAX defaults."""

    positional: Literal["ggd_bam", "alibi", "nope", "rope", "sinusoidal"] = doc(
        "rope", "Positional scheme of the SWA layers (the SWAX paper uses RoPE); any of the attention schemes."
    )
    ssmax: bool = doc(False, "Scalable softmax in the SWA layers (off in the SWAX paper).")
    window: int = doc(
        2048,
        "Window in tokens (the token itself included: key j is seen by query i iff i - window < j <= i) "
        "used when the call gives none (evaluation, inference); training steps take theirs from `window.*`.",
    )


@dataclass
class MLstmConfig:
    n_heads: Optional[int] = doc(None, "mLSTM heads; null = model.n_heads. Must divide model.d_model / 2.")
    chunk_size: int = doc(64, "Time steps per chunk of the chunkwise (training) form; cost grows as N·chunk_size.")
    gate_soft_cap: float = doc(15.0, "Input/forget gate pre-activations are soft-capped to cap·tanh(x/cap).")
    eps: float = doc(1e-6, "Added to the denominator max(|q·n|, exp(-m)) of the cell output.")
    igate_bias_init: float = doc(-10.0, "Initial input-gate bias of every head.")
    fgate_bias_init: list[float] = doc(
        [3.0, 6.0], "[first head, last head] initial forget-gate biases, spread linearly (σ near 1: long memory at init)."
    )


@dataclass
class GatedDeltaNetConfig:
    n_heads: Optional[int] = doc(None, "Gated DeltaNet heads; null = model.n_heads. Must divide model.d_model.")
    conv_size: int = doc(4, "Kernel length of the short causal depthwise convolutions on q, k and v.")
    chunk_size: int = doc(64, "Time steps per chunk of the chunkwise (training) form.")


@dataclass
class ModelConfig:
    vocab_size: int = doc(4096, "Vocabulary size; the tokenizer is trained to exactly this size.")
    d_model: int = doc(128, "Residual stream width.")
    n_layers: int = doc(4, "Number of blocks.")
    n_heads: int = doc(4, "Attention heads per layer; must divide d_model.")
    ffn_hidden: Optional[int] = doc(None, "SwiGLU hidden width; null = 8/3·d_model rounded up to a multiple of 64.")
    layer_pattern: list[str] = doc(
        ["attention"],
        "Mixer of each layer (attention, swa, mlstm, gated_deltanet), repeated cyclically over n_layers (n_layers "
        "must be a multiple); an entry of capitals is a compact pattern, one letter a layer: A, S, M, G (e.g. [SM]).",
    )
    tie_embeddings: bool = doc(True, "Share the input embedding and the output projection.")
    norm_eps: float = doc(1e-5, "RMSNorm epsilon.")
    init_std: float = doc(0.02, "Standard deviation of weight initialisation.")
    attention: AttentionConfig = doc(AttentionConfig, "Full attention mixer (`attention`) settings.")
    swa: SlidingWindowConfig = doc(SlidingWindowConfig, "Sliding-window attention mixer (`swa`) settings.")
    mlstm: MLstmConfig = doc(MLstmConfig, "mLSTM mixer (`mlstm`) settings.")
    gated_deltanet: GatedDeltaNetConfig = doc(GatedDeltaNetConfig, "Gated DeltaNet mixer (`gated_deltanet`) settings.")
    kernels: Literal["auto", "triton", "reference"] = doc(
        "auto",
        "Attention and chunkwise mLSTM ops: auto = Triton kernels on CUDA tensors, PyTorch references on CPU; triton or reference "
        "forces one (env MEGABAM_KERNELS overrides; triton on CPU only under TRITON_INTERPRET=1).",
    )


@dataclass
class WindowConfig:
    """The per-step window of the sliding-window attention layers (megabam/train/window_sampler.py)."""

    windows: list[int] = doc([128, 2048], "Candidate windows in tokens; one is drawn for every optimizer step.")
    probabilities: list[float] = doc(
        [0.5, 0.5], "Probability of each window, in the order of `windows` (sums to 1); one window with 1.0 = fixed."
    )
    anneal_fraction: float = doc(0.1, "The last this share of the steps uses anneal_window only (no draw).")
    anneal_window: Optional[int] = doc(None, "Window of the annealing steps; null = the largest of `windows`.")


@dataclass
class ParallelConfig:
    tensor: int = doc(1, "Tensor-parallel size.")
    pipeline: int = doc(
        1, "Pipeline-parallel size: DeepSpeed's pipeline engine (1F1B) over train.grad_accum micro-batches "
        "per step; needs zero_stage 1."
    )
    pipeline_boundaries: list[int] = doc(
        [], "First layer index of each pipeline stage after the first (pipeline − 1 increasing indices); "
        "empty = stages balanced by parameter count. The embedding joins the first stage, the final norm and "
        "head the last."
    )
    sequence_parallel: bool = doc(
        False, "Megatron sequence parallelism on top of tensor parallelism: norms and residuals hold "
        "sequence shards (N/tensor tokens per rank); needs tensor > 1 and sequence lengths divisible by tensor."
    )
    zero_stage: int = doc(1, "DeepSpeed ZeRO stage (0, 1, 2) over the data-parallel group.")
    recompute: Literal["none", "selective", "full"] = doc(
        "none", "Activation recomputation: none; selective = the mixers named in recompute_mixers; full = every block."
    )
    recompute_mixers: list[str] = doc(
        ["attention", "swa", "mlstm", "gated_deltanet"], "Mixer types recomputed when recompute=selective."
    )


@dataclass
class StreamConfig:
    path: str = doc("", "A prepared dataset directory (train/, val/), or the local cache of `remote`.")
    remote: Optional[str] = doc(None, "Where the dataset lives when not local (s3://, gs://, ... or a directory); null = path only.")
    weight: Optional[float] = doc(None, "Relative share of training samples (set on every stream or on none).")
    repeat: Optional[float] = doc(None, "Instead of a weight: times each sample is drawn per epoch (fractions subsample).")


@dataclass
class DataConfig:
    source: Literal["default", "mds"] = doc(
        "default", "default = Python's stdlib sources + synthetic passkey samples, built offline and cached; "
        "mds = datasets written by `megabam data prepare` / `synth`, listed in data.streams."
    )
    streams: list[StreamConfig] = doc([], "data.source=mds: the prepared datasets to mix (path, remote, weight or repeat).")
    tokenizer: Optional[str] = doc(None, "data.source=mds: the sentencepiece .model the streams were tokenized with.")
    verify_hashes: bool = doc(
        False, "data.source=mds: check every local shard's sha1 before training (reads all data once; "
        "sizes are always checked, remote shards are hashed by streaming when downloaded)."
    )
    seq_len: int = doc(256, "Tokens per training sequence.")
    corpus_bytes: int = doc(4_000_000, "Bytes of stdlib source text in the default corpus.")
    passkey_fraction: float = doc(0.25, "Share of training samples that are passkey-retrieval documents.")
    val_fraction: float = doc(0.02, "Share of samples held out for validation.")
    cache_dir: Optional[str] = doc(None, "Where built datasets are cached; null = $MEGABAM_CACHE or ~/.cache/megabam.")
    num_workers: int = doc(0, "DataLoader worker processes.")


@dataclass
class OptimConfig:
    lr: float = doc(3e-3, "Peak learning rate.")
    weight_decay: float = doc(0.1, "AdamW weight decay (never on norms, biases, prior parameters or SSMax s).")
    betas: list[float] = doc([0.9, 0.95], "AdamW betas.")
    eps: float = doc(1e-8, "AdamW epsilon.")
    prior_lr_mult: float = doc(1.0, "Learning-rate multiplier of the BAM prior parameters θ.")
    ssmax_lr_mult: float = doc(1.0, "Learning-rate multiplier of the SSMax s parameters.")
    grad_clip: float = doc(1.0, "Clip the global gradient norm to this value; 0 = off.")


@dataclass
class ScheduleConfig:
    kind: Literal["cosine", "wsd", "constant"] = doc(
        "cosine", "cosine: warmup then cosine decay; wsd: warmup, stable, then linear decay; constant: warmup then flat."
    )
    warmup_steps: int = doc(20, "Linear warmup steps.")
    min_lr_ratio: float = doc(0.1, "Final learning rate as a fraction of the peak.")
    decay_fraction: float = doc(0.2, "wsd: share of the steps spent decaying at the end.")


@dataclass
class TrainConfig:
    steps: int = doc(300, "Optimizer steps.")
    micro_batch_size: int = doc(8, "Sequences per micro-batch per data-parallel rank.")
    grad_accum: int = doc(1, "Micro-batches accumulated per optimizer step.")
    precision: Literal["fp32", "bf16"] = doc("fp32", "Training precision (bf16 keeps fp32 master weights).")
    eval_every: int = doc(0, "Validation every this many steps (0 = only at the end).")
    eval_batches: int = doc(8, "Validation micro-batches per evaluation.")
    max_bad_steps: int = doc(
        5, "Stop after this many consecutive steps whose loss or gradient norm is not finite (each is skipped); 0 = never stop."
    )
    debug_nan_steps: list[int] = doc([], "Steps whose loss is made NaN on purpose, to exercise the bad-step guard.")


@dataclass
class EvalConfig:
    passkey_samples: int = doc(16, "Passkey prompts scored per length at the end of training (0 = off).")
    passkey_lengths: list[int] = doc([], "Passkey prompt lengths in tokens; empty = data.seq_len. Longer = extrapolation.")


@dataclass
class CheckpointConfig:
    every: int = doc(100, "Save a checkpoint every this many steps (and always at the end); 0 = only at the end.")
    keep: int = doc(3, "Keep the newest this many checkpoints; older ones are deleted after a save.")


@dataclass
class LoggingConfig:
    log_every: int = doc(10, "Log metrics every this many steps.")
    progress_bar: bool = doc(True, "Show a progress bar on rank 0.")
    wandb_mode: Literal["offline", "online", "disabled"] = doc(
        "offline", "wandb mode; offline needs no account; online only when you configure it."
    )
    wandb_project: str = doc("megabam", "wandb project name.")
    peak_tflops: Optional[float] = doc(
        None, "Peak TFLOP/s of one device for the MFU estimate; null = known GPUs only, no MFU elsewhere."
    )


@dataclass
class Config:
    run: RunConfig = doc(RunConfig, "Run identity.")
    model: ModelConfig = doc(ModelConfig, "Model shape and mixers.")
    window: WindowConfig = doc(WindowConfig, "Per-step window of the sliding-window attention layers (used when the pattern has `swa`).")
    parallel: ParallelConfig = doc(ParallelConfig, "Parallel layout.")
    data: DataConfig = doc(DataConfig, "Training data.")
    optim: OptimConfig = doc(OptimConfig, "Optimizer.")
    schedule: ScheduleConfig = doc(ScheduleConfig, "Learning-rate schedule.")
    train: TrainConfig = doc(TrainConfig, "Training loop.")
    eval: EvalConfig = doc(EvalConfig, "Evaluation at the end of training.")
    checkpoint: CheckpointConfig = doc(CheckpointConfig, "Checkpointing.")
    logging: LoggingConfig = doc(LoggingConfig, "Logging.")
