"""`megabam convert from-hf DIR OUT`: a Hugging Face folder back as a megabam consolidated folder.

A megabam export (`to-hf`) comes back bit for bit: its weights under the Decoder's names, with the
run's config and metadata it carries. OUT is a consolidated folder (megabam/convert/consolidate.py):
`megabam train CONFIG train.init_from=OUT` continues pretraining from it (the optimizer, schedule and
data start fresh; the optimizer state does not travel through an export), and `megabam eval` and
`convert to-hf` read it as they read any consolidated folder.
"""

import json
import shutil
import time
from pathlib import Path

import torch

from megabam.config import ConfigError, load_config
from megabam.config.loader import save_config
from megabam.convert.consolidate import FORMAT, MARKER, Consolidated
from megabam.convert.hf_export import CONFIG_FILE, PREFIX
from megabam.convert.output import check_output, output_folder
from megabam.convert.safetensors_out import read_model, weight_files, write_model
from megabam.model import Decoder
from megabam.train.checkpoint import META_FILE, CheckpointError, CheckpointMeta


def from_hf(folder: Path, out: Path, overwrite: bool = False) -> list[str]:
    from safetensors import SafetensorError, safe_open

    start = time.perf_counter()
    try:
        hf_config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder / 'config.json'}: not readable as JSON ({e})") from None
    kind = hf_config.get("model_type") if isinstance(hf_config, dict) else None
    if kind != "megabam":
        raise CheckpointError(f"{folder / 'config.json'}: model_type {kind!r}; from-hf imports megabam exports")
    try:
        config = load_config(folder / CONFIG_FILE)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    check_output(out, overwrite, folder)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Decoder(config.model).state_dict().items()}
    where: dict[str, str] = {}
    try:
        for file in weight_files(folder):
            with safe_open(folder / file, "pt") as f:
                for key in f.keys():
                    where[key] = file
                    name = key.removeprefix(PREFIX)
                    if name not in shapes:
                        raise CheckpointError(f"{folder / file}: holds {key}, which the config's model has not")
                    if tuple(f.get_slice(key).get_shape()) != shapes[name]:
                        raise CheckpointError(
                            f"{folder / file}: {key} has shape {f.get_slice(key).get_shape()}, "
                            f"the config's model {list(shapes[name])}"
                        )
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{folder}: weights not readable ({str(e).splitlines()[0]})") from None
    missing = sorted(set(shapes) - {k.removeprefix(PREFIX) for k in where})
    if missing:
        raise CheckpointError(f"{folder}: has no tensor {PREFIX}{missing[0]} (the config's model has it)")
    with safe_open(folder / next(iter(where.values())), "pt") as f:
        dtype = f.get_tensor(next(iter(where))).dtype

    def fetch(name: str) -> torch.Tensor:
        with safe_open(folder / where[PREFIX + name], "pt") as f:
            return f.get_tensor(PREFIX + name)

    meta = CheckpointMeta.read(folder / META_FILE)
    with output_folder(out) as tmp:
        files = write_model(tmp, list(shapes.items()), dtype, fetch, 5 * 10**9)
        save_config(config, tmp / "config.yaml")
        shutil.copyfile(folder / "tokenizer.model", tmp / "tokenizer.model")
        (tmp / META_FILE).write_text(meta.to_json())
        marker = {"format": FORMAT, "version": 1, "source": str(folder), "step": meta.step}
        marker |= {
            "dtype": {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype],
            "imported_from": "hf",
            "weights": files,
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return [
        f"imported {folder} (megabam export of step {meta.step}) into {out} in {time.perf_counter() - start:.1f} s",
        f"continue pretraining: megabam train CONFIG train.init_from={out} (the optimizer starts fresh)",
    ]


def is_export(folder: Path) -> bool:
    """Whether `folder` is a megabam export (`convert to-hf`)."""
    return (folder / "config.json").is_file() and (folder / CONFIG_FILE).is_file()


def read_export(folder: Path) -> Consolidated:
    """The one-process model (float32), config, metadata and tokenizer of a megabam export."""
    from safetensors import SafetensorError

    try:
        config = load_config(folder / CONFIG_FILE)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    model = Decoder(config.model)
    try:
        state = {k.removeprefix(PREFIX): v.float() for k, v in read_model(folder).items()}
        model.load_state_dict(state)
    except (OSError, RuntimeError, KeyError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"{folder}: weights do not fit its {CONFIG_FILE} ({str(e).splitlines()[0]})") from None
    return Consolidated(model, config, CheckpointMeta.read(folder / META_FILE), folder / "tokenizer.model")
