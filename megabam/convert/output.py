"""Every conversion writes into a temporary folder beside its output and renames it at the end, so an
interrupted or failed conversion leaves no half-written output and never touches an existing one
(which --overwrite replaces only once the new one is complete)."""

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from megabam.errors import UserError


class OutputError(UserError):
    """An output folder that cannot be written; the message names it."""


def check_output(out: Path, overwrite: bool, source: Path) -> None:
    """Refuse, before anything is read or written, an output that exists (without --overwrite) or that
    lies inside the input (which is never modified)."""
    out, source = out.resolve(), source.resolve()
    if out == source or source in out.parents or out in source.parents:
        raise OutputError(out, None, f"the output must lie outside the input {source} (the input is never modified)")
    if out.exists() and not overwrite:
        raise OutputError(out, None, "already exists (pass --overwrite to replace it)")
    if out.exists() and not out.is_dir():
        raise OutputError(out, None, "exists and is not a folder")


@contextlib.contextmanager
def output_folder(out: Path) -> Iterator[Path]:
    """A fresh temporary folder beside `out`; renamed to `out` when the block completes, removed if
    it raises. An existing `out` is moved aside first and deleted only after the rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old)
