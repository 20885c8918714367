"""`megabam convert consolidate CKPT OUT`: a checkpoint of any layout as one folder of full tensors;
`megabam convert average CKPT CKPT... OUT`: the mean of several checkpoints' weights, the same way.

OUT holds the model's weights under the names of the one-process `Decoder` (its state dict) in
safetensors (sharded with an index past --max-shard-size), the resolved config (config.yaml), the
tokenizer, the checkpoint's metadata (megabam.json) and consolidated.json (source, dtype, layout;
the checkpoints averaged).
Weights only: the optimizer state stays with the checkpoint. The weights are the ones the model
computes with (a bf16 run's bf16 weights; --dtype fp32 widens them exactly).

Tensors are read, put together and written one at a time (megabam/checkpoint/reader.py,
safetensors_out.py), so peak memory is about the largest tensor's full size times a small factor.
"""

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from megabam.checkpoint.reader import CheckpointReader
from megabam.checkpoint.safetensors_io import read_model, weight_files, write_model
from megabam.checkpoint.store import META_FILE, CheckpointError, CheckpointMeta
from megabam.config import Config, ConfigError, load_config
from megabam.config.loader import save_config
from megabam.data.tokenizer import copy_tokenizer, load_tokenizer, tokenizer_in
from megabam.model import Decoder
from megabam.staging import check_output, staged_folder

MARKER = "consolidated.json"
FORMAT = "megabam-consolidated"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def consolidate(
    source: Path, out: Path, dtype: str = "fp32", max_shard_bytes: int = 5 * 10**9, overwrite: bool = False
) -> list[str]:
    """Write the consolidated folder `out` from checkpoint (or run directory) `source`; returns the
    summary lines. Everything is checked before anything is written."""
    return average([source], out, dtype, max_shard_bytes, overwrite)


def average(
    sources: list[Path], out: Path, dtype: str = "fp32", max_shard_bytes: int = 5 * 10**9, overwrite: bool = False
) -> list[str]:
    """Write the consolidated folder `out` holding the mean of the weights of `sources`, checkpoints
    (or run directories) of one model, with the config and metadata of the newest; returns the
    summary lines. Averaging the checkpoints of a run's last steps (Polyak averaging, as Llama 3 does
    over its annealing) smooths what the last updates did to one checkpoint. The mean is taken in
    float64, so the order of the sources does not change it. Everything is checked before anything
    is written."""
    start = time.perf_counter()
    readers = [CheckpointReader(s) for s in sources]
    seen: dict[Path, Path] = {}
    for s, reader in zip(sources, readers):
        path = reader.path.resolve()
        if path in seen:
            raise CheckpointError(s, None, f"names the checkpoint {path} that {seen[path]} names too")
        seen[path] = s
        check_output(out, overwrite, reader.path)
        reader.check()
    newest = max(readers, key=lambda r: r.meta.step)
    for s, reader in zip(sources, readers):
        differ = _differences(reader.config.model, newest.config.model)
        if differ:
            raise CheckpointError(s, None, f"another model than {newest.path}: {'; '.join(differ)}")
    tokenizer = newest.tokenizer_path()
    entries = list(newest.shapes.items())
    if len(readers) == 1:
        fetch = newest.tensor  # as stored: --dtype fp32 widens it exactly
    else:

        def fetch(name: str) -> torch.Tensor:
            return sum(r.tensor(name).double() for r in readers) / len(readers)

    with staged_folder(out, replace=overwrite) as tmp:
        desc = "consolidate" if len(readers) == 1 else "average"
        files = write_model(tmp, entries, DTYPES[dtype], fetch, max_shard_bytes, desc=desc)
        save_config(newest.config, tmp / "config.yaml")
        copy_tokenizer(load_tokenizer(tokenizer), tmp)
        (tmp / META_FILE).write_text(newest.meta.to_json())
        layout = {"tensor": newest.tp, "pipeline": newest.pp}
        marker = {"format": FORMAT, "version": 1, "source": str(newest.path), "step": newest.meta.step}
        if len(readers) > 1:
            marker["averaged"] = [{"source": str(r.path), "step": r.meta.step} for r in readers]
        marker |= {"dtype": dtype, "trained_layout": layout, "weights": files}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    params = sum(torch.Size(shape).numel() for _, shape in entries)
    seconds = f"{time.perf_counter() - start:.1f} s"
    summary = f"{len(entries)} tensors, {params:,} parameters, {dtype}, {len(files)} file(s) in {seconds}"
    if len(readers) == 1:
        return [
            f"consolidated {newest.path} (step {newest.meta.step}, tensor {newest.tp} × pipeline {newest.pp})",
            f"into {out}: {summary}",
        ]
    steps = ", ".join(str(r.meta.step) for r in readers)
    return [f"averaged {len(readers)} checkpoints (steps {steps}) of {newest.run_dir}", f"into {out}: {summary}"]


def is_consolidated(path: Path) -> bool:
    return (path / MARKER).is_file()


@dataclass
class Consolidated:
    model: Decoder
    config: Config
    meta: CheckpointMeta
    tokenizer: Path | None  # None: a model imported without one (from-hf of a bare Llama)


def read_consolidated(folder: Path) -> Consolidated:
    """The one-process model (float32), config, metadata and tokenizer of a consolidated folder."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(folder / MARKER, None, f"not readable as JSON ({e})") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise CheckpointError(folder / MARKER, None, f"not a {FORMAT} marker")
    try:
        config = load_config(folder / "config.yaml")
    except ConfigError as e:
        raise CheckpointError(e.source, e.key, e.message) from None
    meta = CheckpointMeta.read(folder / META_FILE)
    model = Decoder(config.model)
    try:
        state = read_model(folder)
        model.load_state_dict({k: v.float() for k, v in state.items()})
    except (OSError, RuntimeError, KeyError, ValueError, SafetensorError) as e:
        raise CheckpointError(folder, None, f"weights do not fit its config.yaml ({str(e).splitlines()[0]})") from None
    return Consolidated(model, config, meta, tokenizer_in(folder))


# Keys of the model config that only set initial values (or choose kernels): a run may start from a
# folder whose config differs in them.
INIT_ONLY = {"kernels", "init_std", "ssmax_init", "init", "igate_bias_init", "fgate_bias_init"}


def _differences(a, b, prefix: str = "model") -> list[str]:
    out = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x):
            out += _differences(x, y, f"{prefix}.{f.name}")
        elif f.name not in INIT_ONLY and x != y:
            out.append(f"{prefix}.{f.name} ({y!r} there, {x!r} here)")
    return out


def load_initial_weights(model: Decoder, model_config, folder: Path) -> CheckpointMeta:
    """Copy the weights of consolidated folder `folder` into `model`, freshly built from `model_config`
    (before any parallelism splits it), a tensor at a time; returns the folder's metadata. A folder of
    another architecture is refused with the config keys that differ."""
    if not is_consolidated(folder):
        raise CheckpointError(folder, None, f"not a consolidated folder (no {MARKER}; see megabam convert consolidate)")
    try:
        theirs = load_config(folder / "config.yaml").model
    except ConfigError as e:
        raise CheckpointError(e.source, e.key, e.message) from None
    differ = _differences(model_config, theirs)
    if differ:
        raise ConfigError("<train.init_from>", "train.init_from", f"{folder} has another model: {'; '.join(differ)}")
    from safetensors import SafetensorError, safe_open

    try:
        files = weight_files(folder)
    except ValueError as e:
        raise ConfigError("<train.init_from>", "train.init_from", str(e)) from None
    found = {}
    state = model.state_dict()
    try:  # a file missing, cut short or with a header pointing past its end: one line, naming the folder
        for file in files:
            with safe_open(folder / file, "pt") as f:
                found.update({name: file for name in f.keys()})
        if set(found) != set(state):
            missing = sorted(set(state) - set(found)) or sorted(set(found) - set(state))
            raise CheckpointError(folder, None, f"its tensors do not match the model's (first differing: {missing[0]})")
        with torch.no_grad():
            for name, target in state.items():
                with safe_open(folder / found[name], "pt") as f:
                    value = f.get_tensor(name)
                if value.shape != target.shape:
                    raise CheckpointError(
                        folder, None, f"{name} has shape {list(value.shape)}, the model {list(target.shape)}"
                    )
                target.copy_(value)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(folder, None, f"weights not readable ({str(e).splitlines()[0]})") from None
    return CheckpointMeta.read(folder / META_FILE)
