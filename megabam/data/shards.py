"""Writing packed samples as mosaicml-streaming MDS shards."""

import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

from megabam.data.packing import PackedSample
from megabam.data.streaming_import import import_streaming

COLUMNS = {"tokens": "ndarray:int32", "doc_starts": "ndarray:int32"}


def write_mds(
    samples: Iterable[PackedSample],
    out_dir: str | os.PathLike,
    compression: str | None = "zstd",
    size_limit: int | str = "8mb",
) -> int:
    """Write ``samples`` as an MDS dataset in ``out_dir``; return the number written.

    Shards (with sha1 hashes) are written into a temporary sibling directory, renamed to
    ``out_dir`` only once complete, so ``out_dir`` never holds a partial dataset; if ``samples``
    raises, the temporary directory is removed. Refuses (ValueError) when ``out_dir`` exists.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ValueError(f"refusing to write MDS shards into existing path {out_dir}")
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex}"
    streaming = import_streaming()
    writer = streaming.MDSWriter(
        out=str(tmp_dir),
        columns=COLUMNS,
        compression=compression,
        hashes=["sha1"],
        size_limit=size_limit,
    )
    count = 0
    try:
        for sample in samples:
            writer.write({"tokens": sample.tokens, "doc_starts": sample.doc_starts})
            count += 1
    except BaseException:
        writer.cancel_future_jobs()  # stop the writer's (upload) threads; no index is written
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    try:
        writer.finish()
        if out_dir.exists():  # appeared while writing; os.rename would replace an empty one
            raise ValueError(f"refusing to write MDS shards into existing path {out_dir}")
        os.rename(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return count
