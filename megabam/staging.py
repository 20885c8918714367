"""Outputs written whole or not at all: each is built under a staged name beside its final one and
renamed into place when complete, so a reader (or a rerun after a kill) never sees half of it.

One staged form for all of them, `.NAME.tmp-<32 hex>` beside NAME, which `is_staged` recognises (a
killed process leaves only such a hidden sibling). Checkpoints are the one exception: every rank
writes into `checkpoints/.tmp-step_N/` together (megabam/checkpoint/store.py), renamed by rank 0.
"""

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megabam.errors import UserError

STAGED = re.compile(r"^\..+\.tmp-[0-9a-f]{32}$")


class OutputError(UserError):
    """An output that cannot be written as asked; the message names it."""


def staged_name(out: Path) -> Path:
    """A fresh staged name for `out`, beside it."""
    return out.parent / f".{out.name}.tmp-{uuid.uuid4().hex}"


def is_staged(path: Path) -> bool:
    return bool(STAGED.match(path.name))


def check_output(out: Path, overwrite: bool, source: Path | None = None) -> None:
    """Refuse, before any work, an output folder that exists (without --overwrite), or is a file, or
    that is, holds or lies inside the input `source` (which is never modified)."""
    if source is not None:
        out_r, source_r = out.resolve(), source.resolve()
        if out_r == source_r or source_r in out_r.parents or out_r in source_r.parents:
            message = f"the output must lie outside the input {source_r} (the input is never modified)"
            raise OutputError(out_r, None, message)
    if out.exists() and not overwrite:
        raise OutputError(out, None, "already exists (pass --overwrite to replace it)")
    if out.exists() and not out.is_dir():
        raise OutputError(out, None, "exists and is not a folder")


@contextmanager
def staged_path(out: Path, fsync: bool = False) -> Iterator[Path]:
    """A staged name for the file `out` (not created): write it in the block; it becomes `out` (replacing
    one) when the block completes, and is removed if it raises. `fsync`: on disk before the rename,
    for files a crash must not leave empty (checkpoint metadata)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = staged_name(out)
    try:
        yield tmp
        if fsync:
            with tmp.open("rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(out: Path, text: str, fsync: bool = False) -> Path:
    with staged_path(out, fsync) as tmp:
        tmp.write_text(text)
    return out


def write_json(out: Path, data, fsync: bool = False) -> Path:
    return write_text(out, json.dumps(data, indent=1) + "\n", fsync)


@contextmanager
def staged_folder(out: Path, replace: bool = False) -> Iterator[Path]:
    """A fresh staged folder for `out`: fill it in the block; it becomes `out` when the block completes
    and is removed if it raises. An `out` that exists by then is replaced only with `replace` (moved
    aside, deleted once the new one is in place), else refused: it appeared while this one was built."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = staged_name(out)
    tmp.mkdir()
    old = staged_name(out)
    try:
        yield tmp
        if out.exists():
            if not replace:
                raise OutputError(out, None, "appeared while this output was being written; nothing replaced")
            os.rename(out, old)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
