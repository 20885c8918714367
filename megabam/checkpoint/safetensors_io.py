"""Writing safetensors files a tensor at a time (the format: an 8-byte little-endian header length,
the JSON header of every tensor's dtype, shape and byte range, then the raw bytes in that order).

The header is known before any tensor is read (names, shapes and dtypes come from the model's
config), so each tensor is fetched, written and dropped in turn: peak memory is one tensor, not the
file. Files over a size are split Hugging Face's way (model-00001-of-0000N.safetensors and
model.safetensors.index.json); safetensors' own reader and transformers read them.
"""

import json
import math
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from megabam.progress import Progress

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '1000000' → bytes (decimal units, as Hugging Face's max_shard_size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", text.upper())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB)")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def shard_names(entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into files of at most `max_bytes` each (a larger tensor gets one alone)."""
    files: list[list[str]] = [[]]
    size = 0
    for name, shape in entries:
        n = nbytes(shape, dtype)
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += n
    return files


def write_file(
    path: Path,
    entries: list[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    fetch: Callable[[str], Tensor],
    progress: Progress | None = None,
) -> int:
    """One safetensors file of `entries` (name, shape) in `dtype`, each tensor from `fetch(name)`;
    returns the bytes of tensor data written. `progress` advances by each tensor's bytes once written."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries:
        n = nbytes(shape, dtype)
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in entries:
            t = fetch(name).to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: fetched shape {list(t.shape)}, expected {list(shape)}")
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            del t
            if progress is not None:
                progress.advance(nbytes(shape, dtype))
        f.flush()
        os.fsync(f.fileno())
    return offset


def write_model(
    folder: Path,
    entries: list[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    fetch,
    max_bytes: int,
    desc: str | None = None,
) -> list[str]:
    """The model's tensors into `folder`: model.safetensors, or shards with an index past `max_bytes`.
    `desc` names the progress (megabam/progress.py) of the bytes of tensors written of all of them."""
    with Progress(desc or "", sum(nbytes(s, dtype) for _, s in entries), "B", True, enabled=desc is not None) as p:
        return _write_model(folder, entries, dtype, fetch, max_bytes, p)


def _write_model(folder: Path, entries, dtype: torch.dtype, fetch, max_bytes: int, progress: Progress) -> list[str]:
    groups = shard_names(entries, dtype, max_bytes)
    shapes = dict(entries)
    if len(groups) == 1:
        write_file(folder / SINGLE, entries, dtype, fetch, progress)
        return [SINGLE]
    names = [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    total = 0
    for file, group in zip(names, groups):
        total += write_file(folder / file, [(n, shapes[n]) for n in group], dtype, fetch, progress)
    weight_map = {n: file for file, group in zip(names, groups) for n in group}
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return [*names, INDEX]


def weight_files(folder: Path) -> list[str]:
    """The safetensors files of a folder written by `write_model` (or by transformers' save_pretrained).
    ValueError names an index that is not one, or that names a file outside the folder."""
    if not (folder / INDEX).is_file():
        return [SINGLE]
    try:
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{folder / INDEX}: not a safetensors index (a weight_map of tensor → file)") from None
    for name in files:  # an index is data: it may point nowhere but at files beside it
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"{folder / INDEX}: names {name!r}, which is not a file in {folder}")
    return files


def read_model(folder: Path) -> dict[str, Tensor]:
    """Every tensor of a folder written by `write_model` (or by transformers' save_pretrained)."""
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for file in weight_files(folder):
        state.update(load_file(folder / file))
    return state
