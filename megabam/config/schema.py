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


@dataclass
class ModelConfig:
    vocab_size: int = doc(4096, "Vocabulary size; the tokenizer is trained to exactly this size.")
    d_model: int = doc(128, "Residual stream width.")
    n_layers: int = doc(4, "Number of blocks.")
    n_heads: int = doc(4, "Attention heads per layer; must divide d_model.")
    ffn_hidden: Optional[int] = doc(None, "SwiGLU hidden width; null = 8/3·d_model rounded up to a multiple of 64.")
    layer_pattern: list[str] = doc(
        ["attention"], "Mixer of each layer, repeated cyclically over n_layers (n_layers must be a multiple)."
    )
    tie_embeddings: bool = doc(True, "Share the input embedding and the output projection.")
    norm_eps: float = doc(1e-5, "RMSNorm epsilon.")
    init_std: float = doc(0.02, "Standard deviation of weight initialisation.")
    attention: AttentionConfig = doc(AttentionConfig, "Attention mixer settings.")


@dataclass
class ParallelConfig:
    tensor: int = doc(1, "Tensor-parallel size.")
    pipeline: int = doc(1, "Pipeline-parallel size.")
    zero_stage: int = doc(1, "DeepSpeed ZeRO stage (0, 1, 2) over the data-parallel group.")


@dataclass
class DataConfig:
    source: Literal["default"] = doc(
        "default", "default = Python's stdlib sources + synthetic passkey samples, built offline and cached."
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


@dataclass
class EvalConfig:
    passkey_samples: int = doc(16, "Passkey prompts scored per length at the end of training (0 = off).")
    passkey_lengths: list[int] = doc([], "Passkey prompt lengths in tokens; empty = data.seq_len. Longer = extrapolation.")


@dataclass
class CheckpointConfig:
    every: int = doc(100, "Save a checkpoint every this many steps (and always at the end); 0 = only at the end.")


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
    parallel: ParallelConfig = doc(ParallelConfig, "Parallel layout.")
    data: DataConfig = doc(DataConfig, "Training data.")
    optim: OptimConfig = doc(OptimConfig, "Optimizer.")
    schedule: ScheduleConfig = doc(ScheduleConfig, "Learning-rate schedule.")
    train: TrainConfig = doc(TrainConfig, "Training loop.")
    eval: EvalConfig = doc(EvalConfig, "Evaluation at the end of training.")
    checkpoint: CheckpointConfig = doc(CheckpointConfig, "Checkpointing.")
    logging: LoggingConfig = doc(LoggingConfig, "Logging.")
