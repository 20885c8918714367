"""YAML file + dotted command-line overrides → a validated `Config`.

Every problem is reported as one `ConfigError` naming the file and the dotted key, before any work
starts. Checking happens in passes: structure (unknown keys, types), each section's own rules (its
`check` in schema.py), then the rules that join sections in `validate`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megabam.config.schema import Config, expand_pattern
from megabam.errors import UserError


class ConfigError(UserError):
    """A bad configuration value: the file (or "<defaults>", "<command line>") and the dotted key."""


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read `path` (None = all defaults) with the files its `defaults:` lists, apply `key.sub=value`
    overrides, check and return."""
    source = str(path) if path is not None else "<defaults>"
    origins: dict[str, str] = {}
    raw = compose(Path(path), origins) if path is not None else {}
    for item in overrides:
        _apply_override(raw, item, source)
        key = item.partition("=")[0]
        for set_here in [k for k in origins if k == key or k.startswith(key + ".")]:
            del origins[set_here]  # the command line's now
    try:
        config = _build(Config, raw, "", source)
        _resolve(config)
        validate(config, source)
    except ConfigError as e:  # a key a base file set: name that file
        where = _origin(origins, e.key)
        if where is None or where == e.source:
            raise
        raise ConfigError(where, e.key, e.message) from None
    return config


DEFAULTS_KEY = "defaults"  # a file's list of base files, read first; the file's own values win


def compose(path: Path, origins: dict[str, str] | None = None, chain: tuple[Path, ...] = ()) -> dict:
    """The file's mapping over the files its `defaults:` lists (paths relative to it), in order: later
    files win over earlier ones and the file over all of them, section by section and key by key (a
    list is one value). `origins` gets, for each dotted key a base file set, that file."""
    source = str(path)
    here = path.resolve()
    if here in chain:
        loop = " → ".join(str(p) for p in (*chain, here))
        raise ConfigError(source, DEFAULTS_KEY, f"the files include each other ({loop})")
    raw = _read_yaml(path)
    bases = raw.pop(DEFAULTS_KEY, [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(source, DEFAULTS_KEY, f"expected a list of config files, got {bases!r}")
    merged: dict = {}
    for base in bases:
        base_path = path.parent / base
        if not base_path.is_file():
            raise ConfigError(source, DEFAULTS_KEY, f"{base} is not a file (paths are relative to {path.parent})")
        merged = _merged(merged, compose(base_path, origins, (*chain, here)))
    if origins is not None:  # read in order: what a later file sets is its own
        origins.update(dict.fromkeys(_leaf_keys(raw), source))
    return _merged(merged, raw)


def _read_yaml(path: Path) -> dict:
    source = str(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(source, "<file>", f"cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(source, "<file>", f"not a UTF-8 text file (byte {e.start} is {text_byte(e)})") from None
    if not text.strip() or all(line.lstrip().startswith("#") or not line.strip() for line in text.splitlines()):
        raise ConfigError(source, "<file>", "is empty (give at least one section; defaults alone: omit the file)")
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(source, "<file>", f"not valid YAML ({where}{e.problem or e.context})") from None
    except yaml.YAMLError as e:
        raise ConfigError(source, "<file>", f"not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(source, "<file>", "the top level must be a mapping of sections")
    return raw


def _merged(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _leaf_keys(raw: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in raw.items():
        name = f"{prefix}{key}"
        keys |= _leaf_keys(value, name + ".") if isinstance(value, dict) and value else {name}
    return keys


def _origin(origins: dict[str, str], key: str) -> str | None:
    """The base file that set `key` (a dotted key, maybe indexed: data.streams[0].path) or a key above it."""
    parts = key.split("[")[0].split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in origins:
            return origins[".".join(parts[:n])]
    return None


def config_from_dict(raw: dict, source: str) -> Config:
    """A Config from its dictionary form (a checkpoint's `config` field), checked like a file."""
    config = _build(Config, raw, "", source)
    _resolve(config)
    validate(config, source)
    return config


def _resolve(config: Config) -> None:
    """Values that follow from others unless given: the SWA layers' inference window is the run's final
    training window (checked against it in _validate_windows when given); an SSMax key cap of
    "seq_len" is data.seq_len."""
    if config.model.swa.window is None:
        config.model.swa.window = config.window.final_window()
    for section in (config.model.attention, config.model.swa):
        if section.ssmax_key_cap == "seq_len":
            section.ssmax_key_cap = config.data.seq_len


def text_byte(e: UnicodeDecodeError) -> str:
    return f"0x{e.object[e.start]:02x}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (it would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (first on line {seen[key] + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def flatten(tree: dict, prefix: str = "") -> dict:
    """A config dictionary's leaves by dotted key (a list is one leaf)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def config_differences(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) of every leaf where two config dictionaries differ, by key."""
    x, y = flatten(a), flatten(b)
    return [(key, x.get(key), y.get(key)) for key in sorted(x.keys() | y.keys()) if x.get(key) != y.get(key)]


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
        inner = [t for t in options if t is not type(None)]
        refusals = []
        for each in inner:  # the first annotation the value fits, in the order written
            try:
                return _coerce(each, value, key, source)
            except ConfigError as e:
                refusals.append(e.message)
        raise ConfigError(source, key, "; or ".join(refusals))
    if origin is Literal:
        choices = typing.get_args(tp)
        # YAML 1.1 reads a bare off / on (and no / yes, false / true) as a boolean: `train.compile: off`
        # means the choice "off".
        if isinstance(value, bool) and ("on" if value else "off") in choices:
            value = "on" if value else "off"
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
    """Each section's own rules (`check`, beside its fields in schema.py), then the rules that join
    sections. Each failure names the offending key."""

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(source, key, message)

    for name in (
        "run",
        "model",
        "window",
        "parallel",
        "data",
        "optim",
        "schedule",
        "train",
        "eval",
        "checkpoint",
        "logging",
    ):
        getattr(c, name).check(require, name)
    mixers = set(expand_pattern(c.model.layer_pattern))
    seq_len = c.data.seq_len
    a = c.model.attention
    require(
        a.window is None or 1 <= a.window <= seq_len,
        "model.attention.window",
        f"{a.window} must lie in 1..data.seq_len={seq_len}",
    )
    for section in ("attention", "swa"):
        cap = getattr(c.model, section).ssmax_key_cap
        require(
            cap is None or cap >= seq_len,
            f"model.{section}.ssmax_key_cap",
            f"{cap} must be at least data.seq_len={seq_len} (it acts past the training length only)",
        )
    if "swa" in mixers:
        _validate_windows(c, require)
    require(
        0 <= c.schedule.warmup_steps <= c.train.steps,
        "schedule.warmup_steps",
        f"{c.schedule.warmup_steps} must lie in 0..train.steps={c.train.steps}",
    )
    _validate_tensor_parallel(c, mixers, require)
    _validate_sequence_parallel(c, require)
    _validate_pipeline(c, require)
    # DeepSpeed skips a non-finite update only inside its ZeRO optimizer (stage 1 or 2).
    require(
        c.parallel.zero_stage >= 1 or c.train.max_bad_steps == 0,
        "parallel.zero_stage",
        "stage 0 cannot skip non-finite steps; use 1 or 2, or set train.max_bad_steps=0",
    )


def _validate_windows(c: Config, require) -> None:
    """The sliding-window layers' windows within the sequence (the window section's own rules are
    checked whatever the pattern)."""
    seq_len = c.data.seq_len
    w, s = c.model.swa, c.window
    for i, win in enumerate(s.windows):
        require(1 <= win <= seq_len, f"window.windows[{i}]", f"{win} must lie in 1..data.seq_len={seq_len}")
    require(
        s.anneal_window is None or 1 <= s.anneal_window <= seq_len,
        "window.anneal_window",
        f"{s.anneal_window} must lie in 1..data.seq_len={seq_len}",
    )
    require(1 <= w.window <= seq_len, "model.swa.window", f"{w.window} must lie in 1..data.seq_len={seq_len}")
    final = s.final_window()
    require(
        w.window == final,
        "model.swa.window",
        f"{w.window} contradicts the final training window {final} (window.anneal_window, else the largest of "
        "window.windows); leave it unset to follow them",
    )


def _validate_tensor_parallel(c: Config, mixers: set[str], require) -> None:
    """Tensor parallelism splits heads, SwiGLU hidden units and vocabulary rows evenly over its ranks."""
    m, tp = c.model, c.parallel.tensor
    splits = [
        ("model.n_heads", m.n_heads),
        ("model.vocab_size", m.vocab_size),
        ("model.ffn_hidden", m.ffn_hidden_size()),
    ]
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
    require(
        c.data.seq_len % tp == 0,
        "parallel.sequence_parallel",
        f"parallel.tensor={tp} does not divide data.seq_len={c.data.seq_len}",
    )
    if c.eval.passkey_samples:
        for i, n in enumerate(c.eval.passkey_lengths):
            require(
                n % tp == 0,
                "parallel.sequence_parallel",
                f"parallel.tensor={tp} does not divide eval.passkey_lengths[{i}]={n}",
            )


def _validate_pipeline(c: Config, require) -> None:
    """Pipeline stages need layers to hold and a ZeRO stage DeepSpeed's pipeline engine accepts."""
    pp, n_layers = c.parallel.pipeline, c.model.n_layers
    bounds = c.parallel.pipeline_boundaries
    if pp == 1:
        return
    require(n_layers >= pp, "parallel.pipeline", f"{pp} stages but only model.n_layers={n_layers} layers")
    # DeepSpeed refuses ZeRO-2/3 with its pipeline engine (gradients partitioned while micro-batches
    # are still accumulating them). Without ZeRO its gradient norm counts a tied embedding on both
    # stages that hold it, and in bf16 it writes checkpoints it cannot load. Only stage 1 is right.
    require(
        c.parallel.zero_stage == 1,
        "parallel.zero_stage",
        f"stage {c.parallel.zero_stage} cannot be combined with pipeline parallelism; use 1",
    )
    if bounds:
        require(
            len(bounds) == pp - 1,
            "parallel.pipeline_boundaries",
            f"needs parallel.pipeline − 1 = {pp - 1} indices, got {len(bounds)}",
        )
        require(
            all(a < b for a, b in zip([0] + bounds, bounds + [n_layers])),
            "parallel.pipeline_boundaries",
            f"{bounds} must increase strictly within 1..model.n_layers−1={n_layers - 1}",
        )
    for section in ("attention", "swa"):
        # One prior shared by every layer would need tying across stages, which the pipeline does not do.
        require(
            not getattr(c.model, section).bam.shared_across_layers,
            f"model.{section}.bam.shared_across_layers",
            "a prior shared across layers cannot be split over pipeline stages; set it false",
        )
