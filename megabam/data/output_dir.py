"""Publishing a built dataset or file under its final name only once it is complete."""

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megabam.data.errors import DataError


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse an existing ``out`` unless ``overwrite``; called before any work starts."""
    if out.exists() and not overwrite:
        raise DataError(out, None, "already exists; pass --overwrite to replace it")


@contextmanager
def staged_output(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory of ``out``; rename it to ``out`` when the block succeeds.

    If the block raises (or the process is interrupted), the temporary directory is removed and
    ``out`` is untouched; a killed process leaves only a hidden ``.NAME.tmp-*`` sibling, never a
    partial ``out``. With ``overwrite`` an existing ``out`` is replaced after the new one is built.
    """
    out = Path(out)
    check_output(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex}"
    try:
        yield tmp
        if out.exists():
            check_output(out, overwrite)  # it may have appeared while we were building
            os.rename(out, old)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
