"""YAML file + dotted command-line overrides → a validated `Config`.

Every problem is reported as one `ConfigError` naming the file and the dotted key, before any work
starts. Checking happens in three passes: structure (unknown keys, types), then the cross-field
rules in `validate`.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megabam.config.schema import Config


class ConfigError(ValueError):
    """A bad configuration value; the message names the file and the key."""

    def __init__(self, source: str, key: str, message: str):
        super().__init__(f"{source}: {key}: {message}")
        self.source, self.key = source, key


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read `path` (None = all defaults), apply `key.sub=value` overrides, check and return."""
    source = str(path) if path is not None else "<defaults>"
    raw: dict = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(source, "<file>", f"cannot read ({e.strerror})") from None
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(source, "<file>", f"not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(raw, dict):
            raise ConfigError(source, "<file>", "the top level must be a mapping of sections")
    for item in overrides:
        _apply_override(raw, item, source)
    config = _build(Config, raw, "", source)
    validate(config, source)
    return config


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def save_config(config: Config, path: Path) -> None:
    """Write the resolved config as YAML (loadable again by `load_config`)."""
    path.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))


def _apply_override(raw: dict, item: str, source: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(source, item, "an override must look like section.key=value")
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(source, key, f"'{part}' is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError:
        node[parts[-1]] = value


def _build(cls, raw: Any, prefix: str, source: str):
    if not isinstance(raw, dict):
        raise ConfigError(source, prefix.rstrip(".") or "<file>", f"expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            known = ", ".join(fields)
            raise ConfigError(source, prefix + str(key), f"unknown key (known here: {known})")
    values = {}
    for name in fields:
        if name in raw:
            values[name] = _coerce(hints[name], raw[name], prefix + name, source)
    return cls(**values)


def _coerce(tp, value: Any, key: str, source: str):
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", source)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        (inner,) = [t for t in options if t is not type(None)]
        return _coerce(inner, value, key, source)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(source, key, f"{value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(source, key, f"expected a list, got {value!r}")
        return [_coerce(inner, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(source, key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(source, key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(source, key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(source, key, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp} at {key}")


def validate(c: Config, source: str) -> None:
    """Cross-field rules. Each failure names the offending key."""

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(source, key, message)

    m, a = c.model, c.model.attention
    for key, value in [
        ("model.vocab_size", m.vocab_size), ("model.d_model", m.d_model), ("model.n_layers", m.n_layers),
        ("model.n_heads", m.n_heads), ("data.seq_len", c.data.seq_len), ("train.steps", c.train.steps),
        ("train.micro_batch_size", c.train.micro_batch_size), ("train.grad_accum", c.train.grad_accum),
        ("model.attention.block_size", a.block_size), ("parallel.tensor", c.parallel.tensor),
        ("parallel.pipeline", c.parallel.pipeline), ("logging.log_every", c.logging.log_every),
        ("data.corpus_bytes", c.data.corpus_bytes),
    ]:
        require(value >= 1, key, f"must be at least 1, got {value}")
    require(m.d_model % m.n_heads == 0, "model.n_heads", f"{m.n_heads} does not divide model.d_model={m.d_model}")
    head_dim = m.d_model // m.n_heads
    require(a.positional != "rope" or head_dim % 2 == 0, "model.attention.positional",
            f"rope needs an even head dimension, got {head_dim}")
    for section in ("attention", "swa"):
        kv = getattr(m, section).kv_heads
        require(kv is None or (kv >= 1 and m.n_heads % kv == 0), f"model.{section}.kv_heads",
                f"{kv} does not divide model.n_heads={m.n_heads}")
    require(m.ffn_hidden is None or m.ffn_hidden >= 1, "model.ffn_hidden", f"must be at least 1, got {m.ffn_hidden}")
    require(len(m.layer_pattern) >= 1, "model.layer_pattern", "must name at least one mixer")
    from megabam.model.transformer import MIXERS, PATTERN_LETTERS, expand_pattern, is_compact_pattern

    for i, name in enumerate(m.layer_pattern):  # the registry is the one source of mixer names
        require(name in MIXERS or is_compact_pattern(name), f"model.layer_pattern[{i}]",
                f"unknown mixer {name!r} (known: {', '.join(MIXERS)}, or letters of {''.join(PATTERN_LETTERS)})")
    period = expand_pattern(m.layer_pattern)
    require(m.n_layers % len(period) == 0, "model.n_layers",
            f"{m.n_layers} is not a multiple of the layer_pattern length {len(period)}")
    _validate_swax(c, set(period), require)
    require(a.window is None or 1 <= a.window <= c.data.seq_len, "model.attention.window",
            f"{a.window} must lie in 1..data.seq_len={c.data.seq_len}")
    lo_hi = a.bam.beta_range
    require(len(lo_hi) == 2 and lo_hi[0] <= lo_hi[1], "model.attention.bam.beta_range",
            f"must be [lowest, highest], got {lo_hi}")
    require(0.0 <= a.bam.flat_fraction <= 1.0, "model.attention.bam.flat_fraction",
            f"must lie in [0, 1], got {a.bam.flat_fraction}")
    require(c.optim.lr > 0, "optim.lr", f"must be positive, got {c.optim.lr}")
    require(c.optim.weight_decay >= 0, "optim.weight_decay", f"must be non-negative, got {c.optim.weight_decay}")
    require(len(c.optim.betas) == 2 and all(0 <= b < 1 for b in c.optim.betas), "optim.betas",
            f"must be two values in [0, 1), got {c.optim.betas}")
    require(c.optim.prior_lr_mult >= 0, "optim.prior_lr_mult", f"must be non-negative, got {c.optim.prior_lr_mult}")
    require(c.optim.ssmax_lr_mult >= 0, "optim.ssmax_lr_mult", f"must be non-negative, got {c.optim.ssmax_lr_mult}")
    require(c.optim.grad_clip >= 0, "optim.grad_clip", f"must be non-negative, got {c.optim.grad_clip}")
    require(0 <= c.schedule.warmup_steps <= c.train.steps, "schedule.warmup_steps",
            f"{c.schedule.warmup_steps} must lie in 0..train.steps={c.train.steps}")
    require(0 <= c.schedule.min_lr_ratio <= 1, "schedule.min_lr_ratio", f"must lie in [0, 1], got {c.schedule.min_lr_ratio}")
    require(0 < c.schedule.decay_fraction <= 1, "schedule.decay_fraction",
            f"must lie in (0, 1], got {c.schedule.decay_fraction}")
    require(0 <= c.data.passkey_fraction < 1, "data.passkey_fraction", f"must lie in [0, 1), got {c.data.passkey_fraction}")
    require(0 < c.data.val_fraction < 1, "data.val_fraction", f"must lie in (0, 1), got {c.data.val_fraction}")
    require(c.data.num_workers >= 0, "data.num_workers", f"must be non-negative, got {c.data.num_workers}")
    _validate_streams(c.data, require)
    require(c.parallel.zero_stage in (0, 1, 2), "parallel.zero_stage", f"must be 0, 1 or 2, got {c.parallel.zero_stage}")
    _validate_tensor_parallel(c, set(period), require)
    _validate_sequence_parallel(c, require)
    _validate_pipeline(c, require)
    require(c.train.eval_every >= 0, "train.eval_every", f"must be non-negative, got {c.train.eval_every}")
    require(c.train.eval_batches >= 1, "train.eval_batches", f"must be at least 1, got {c.train.eval_batches}")
    require(c.eval.passkey_samples >= 0, "eval.passkey_samples", f"must be non-negative, got {c.eval.passkey_samples}")
    for i, n in enumerate(c.eval.passkey_lengths):
        require(n >= 1, f"eval.passkey_lengths[{i}]", f"must be at least 1, got {n}")
    require(c.train.max_bad_steps >= 0, "train.max_bad_steps", f"must be non-negative, got {c.train.max_bad_steps}")
    for i, step in enumerate(c.train.debug_nan_steps):
        require(1 <= step <= c.train.steps, f"train.debug_nan_steps[{i}]", f"{step} must lie in 1..train.steps")
    # DeepSpeed skips a non-finite update only inside its ZeRO optimizer (stage 1 or 2).
    require(c.parallel.zero_stage >= 1 or (c.train.max_bad_steps == 0 and not c.train.debug_nan_steps),
            "parallel.zero_stage", "stage 0 cannot skip non-finite steps; use 1 or 2, or set train.max_bad_steps=0")
    from megabam.model.transformer import MIXERS

    for i, name in enumerate(c.parallel.recompute_mixers):
        require(name in MIXERS, f"parallel.recompute_mixers[{i}]", f"unknown mixer {name!r} (known: {', '.join(MIXERS)})")
    require(c.checkpoint.keep >= 1, "checkpoint.keep", f"must be at least 1, got {c.checkpoint.keep}")
    require(c.checkpoint.every >= 0, "checkpoint.every", f"must be non-negative, got {c.checkpoint.every}")
    require(c.logging.peak_tflops is None or c.logging.peak_tflops > 0, "logging.peak_tflops",
            f"must be positive, got {c.logging.peak_tflops}")
    require(c.run.name != "" and "/" not in c.run.name, "run.name", f"must be a plain directory name, got {c.run.name!r}")


def _validate_tensor_parallel(c: Config, mixers: set[str], require) -> None:
    """Tensor parallelism splits heads, SwiGLU hidden units and vocabulary rows evenly over its ranks."""
    from megabam.model.layers import swiglu_hidden

    m, tp = c.model, c.parallel.tensor
    splits = [("model.n_heads", m.n_heads), ("model.vocab_size", m.vocab_size),
              ("model.ffn_hidden", m.ffn_hidden or swiglu_hidden(m.d_model))]
    for mixer in ("attention", "swa"):
        if mixer in mixers and getattr(m, mixer).kv_heads:
            splits.append((f"model.{mixer}.kv_heads", getattr(m, mixer).kv_heads))
    if "mlstm" in mixers:
        splits.append(("model.mlstm.n_heads", m.mlstm.n_heads or m.n_heads))
    if "gated_deltanet" in mixers:
        splits.append(("model.gated_deltanet.n_heads", m.gated_deltanet.n_heads or m.n_heads))
    for key, n in splits:
        require(n % tp == 0, "parallel.tensor", f"{tp} does not divide {key}={n}")


def _validate_sequence_parallel(c: Config, require) -> None:
    """Sequence parallelism shards the sequences of training, validation and passkey scoring over the TP ranks."""
    if not c.parallel.sequence_parallel:
        return
    tp = c.parallel.tensor
    require(tp > 1, "parallel.sequence_parallel", "needs tensor parallelism: set parallel.tensor > 1")
    require(c.data.seq_len % tp == 0, "parallel.sequence_parallel",
            f"parallel.tensor={tp} does not divide data.seq_len={c.data.seq_len}")
    if c.eval.passkey_samples:
        for i, n in enumerate(c.eval.passkey_lengths):
            require(n % tp == 0, "parallel.sequence_parallel",
                    f"parallel.tensor={tp} does not divide eval.passkey_lengths[{i}]={n}")


def _validate_pipeline(c: Config, require) -> None:
    """Pipeline stages need layers to hold and a ZeRO stage DeepSpeed's pipeline engine accepts."""
    pp, n_layers = c.parallel.pipeline, c.model.n_layers
    bounds = c.parallel.pipeline_boundaries
    require(not bounds or pp > 1, "parallel.pipeline_boundaries", "given but parallel.pipeline is 1")
    if pp == 1:
        return
    require(n_layers >= pp, "parallel.pipeline", f"{pp} stages but only model.n_layers={n_layers} layers")
    # DeepSpeed refuses ZeRO-2/3 with its pipeline engine (gradients partitioned while micro-batches
    # are still accumulating them). Without ZeRO its gradient norm counts a tied embedding on both
    # stages that hold it, and in bf16 it writes checkpoints it cannot load. Only stage 1 is right.
    require(c.parallel.zero_stage == 1, "parallel.zero_stage",
            f"stage {c.parallel.zero_stage} cannot be combined with pipeline parallelism; use 1")
    if bounds:
        require(len(bounds) == pp - 1, "parallel.pipeline_boundaries",
                f"needs parallel.pipeline − 1 = {pp - 1} indices, got {len(bounds)}")
        require(all(a < b for a, b in zip([0] + bounds, bounds + [n_layers])), "parallel.pipeline_boundaries",
                f"{bounds} must increase strictly within 1..model.n_layers−1={n_layers - 1}")
    for section in ("attention", "swa"):
        # One prior shared by every layer would need tying across stages, which the pipeline does not do.
        require(not getattr(c.model, section).bam.shared_across_layers, f"model.{section}.bam.shared_across_layers",
                "a prior shared across layers cannot be split over pipeline stages; set it false")


def _validate_swax(c: Config, mixers: set[str], require) -> None:
    """Rules of the sliding-window, mLSTM and Gated DeltaNet sections, checked when the pattern uses them."""
    m = c.model
    if "swa" in mixers:
        w = m.swa
        require(m.d_model // m.n_heads % 2 == 0 or w.positional != "rope", "model.swa.positional",
                f"rope needs an even head dimension, got {m.d_model // m.n_heads}")
        require(1 <= w.window <= c.data.seq_len, "model.swa.window", f"{w.window} must lie in 1..data.seq_len={c.data.seq_len}")
        require(w.block_size >= 1, "model.swa.block_size", f"must be at least 1, got {w.block_size}")
        s = c.window
        require(len(s.windows) >= 1, "window.windows", "must list at least one window")
        for i, win in enumerate(s.windows):
            require(1 <= win <= c.data.seq_len, f"window.windows[{i}]", f"{win} must lie in 1..data.seq_len={c.data.seq_len}")
        require(len(s.probabilities) == len(s.windows), "window.probabilities",
                f"needs one probability per window ({len(s.windows)}), got {len(s.probabilities)}")
        for i, p in enumerate(s.probabilities):
            require(0.0 <= p <= 1.0, f"window.probabilities[{i}]", f"must lie in [0, 1], got {p}")
        require(abs(sum(s.probabilities) - 1.0) < 1e-6, "window.probabilities", f"must sum to 1, got {sum(s.probabilities)}")
        require(0.0 <= s.anneal_fraction <= 1.0, "window.anneal_fraction", f"must lie in [0, 1], got {s.anneal_fraction}")
        require(s.anneal_window is None or 1 <= s.anneal_window <= c.data.seq_len, "window.anneal_window",
                f"{s.anneal_window} must lie in 1..data.seq_len={c.data.seq_len}")
    if "mlstm" in mixers:
        x = m.mlstm
        heads = x.n_heads or m.n_heads
        require(heads >= 1 and (m.d_model // 2) % heads == 0, "model.mlstm.n_heads",
                f"{heads} does not divide model.d_model / 2 = {m.d_model // 2} (q and k are half width)")
        require(x.chunk_size >= 1, "model.mlstm.chunk_size", f"must be at least 1, got {x.chunk_size}")
        require(x.gate_soft_cap > 0, "model.mlstm.gate_soft_cap", f"must be positive, got {x.gate_soft_cap}")
        require(x.eps >= 0, "model.mlstm.eps", f"must be non-negative, got {x.eps}")
        require(len(x.fgate_bias_init) == 2, "model.mlstm.fgate_bias_init", f"must be [first, last], got {x.fgate_bias_init}")
    if "gated_deltanet" in mixers:
        x = m.gated_deltanet
        heads = x.n_heads or m.n_heads
        require(heads >= 1 and m.d_model % heads == 0, "model.gated_deltanet.n_heads",
                f"{heads} does not divide model.d_model={m.d_model}")
        require(x.conv_size >= 1, "model.gated_deltanet.conv_size", f"must be at least 1, got {x.conv_size}")
        require(x.chunk_size >= 1, "model.gated_deltanet.chunk_size", f"must be at least 1, got {x.chunk_size}")


def _validate_streams(d, require) -> None:
    """data.source=mds needs streams and a tokenizer; weights positive, on every stream or none."""
    if d.source != "mds":
        require(not d.streams, "data.streams", "only used with data.source: mds")
        return
    require(len(d.streams) >= 1, "data.streams", "data.source mds needs at least one stream")
    require(bool(d.tokenizer), "data.tokenizer", "data.source mds needs the tokenizer .model of its streams")
    weighted = [s.weight is not None for s in d.streams]
    for i, s in enumerate(d.streams):
        require(s.path != "", f"data.streams[{i}].path", "must name the dataset directory (or local cache)")
        require(s.weight is None or s.weight > 0, f"data.streams[{i}].weight", f"must be positive, got {s.weight}")
        require(s.repeat is None or s.repeat > 0, f"data.streams[{i}].repeat", f"must be positive, got {s.repeat}")
        require(s.weight is None or s.repeat is None, f"data.streams[{i}]", "give a weight or a repeat, not both")
        require(weighted[i] or not any(weighted), f"data.streams[{i}].weight", "set a weight on every stream or on none")
