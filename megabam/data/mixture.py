"""Several prepared datasets mixed by weight: the streams a loader reads."""

import functools
import os
import uuid
from dataclasses import dataclass

from megabam.data.errors import DataError
from megabam.data.streaming_import import import_streaming


@dataclass(frozen=True)
class StreamSpec:
    """One prepared dataset in a mixture.

    ``local`` is the dataset directory, or, with ``remote`` (any URL streaming supports, or a
    directory), the local cache it is downloaded into. ``split`` selects ``train``/``val`` inside
    it (None = the directory itself is the MDS dataset). ``weight`` is the relative share of the
    mixture's samples (all streams weighted, or none); ``repeat`` instead draws each sample of the
    stream that many times per epoch (fractions subsample). Neither: every sample once.
    """

    local: str
    remote: str | None = None
    split: str | None = None
    weight: float | None = None
    repeat: float | None = None


def check_streams(streams: list[StreamSpec]) -> None:
    """Refuse (DataError) an empty mixture, a weight or repeat ≤ 0, or weights on only some streams."""
    if not streams:
        raise DataError("<data>", "data.streams", "a mixture needs at least one stream")
    weighted = [s.weight is not None for s in streams]
    for i, s in enumerate(streams):
        if s.weight is not None and not s.weight > 0:
            raise DataError(s.local, f"data.streams[{i}].weight", f"must be positive, got {s.weight}")
        if s.repeat is not None and not s.repeat > 0:
            raise DataError(s.local, f"data.streams[{i}].repeat", f"must be positive, got {s.repeat}")
        if s.weight is not None and s.repeat is not None:
            raise DataError(s.local, f"data.streams[{i}]", "give a weight or a repeat, not both")
    if any(weighted) and not all(weighted):
        raise DataError("<data>", "data.streams", "give a weight to every stream of a mixture or to none")


def make_streams(streams: list[StreamSpec]) -> list:
    """streaming ``Stream`` objects for ``streams``; weights become proportions summing to 1."""
    check_streams(streams)
    import_streaming()
    total = sum(s.weight for s in streams) if streams[0].weight is not None else None
    return [
        _stream_class()(
            local=os.fspath(s.local),
            remote=s.remote,
            split=s.split,
            proportion=s.weight / total if total else None,
            repeat=s.repeat,
        )
        for s in streams
    ]


@functools.cache
def _stream_class() -> type:
    """streaming's Stream, decompressing a shard through a temporary file of its own. streaming writes
    every process's copy to the same `shard.NNNNN.mds.tmp` before renaming it, so two jobs starting on
    one node on one prepared dataset (zstd shards, prepare's default) raced: one renamed the file the
    other had just renamed (seen: "No such file or directory: ...mds.tmp -> ...mds", a job lost). Both
    write the same bytes, so whichever replace comes last changes nothing a reader sees."""
    streaming = import_streaming()

    class Stream(streaming.Stream):
        def _decompress_shard_part(self, zip_info, zip_filename: str, raw_filename: str, compression) -> None:
            mine = f"{raw_filename}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
            super()._decompress_shard_part(zip_info, zip_filename, mine, compression)
            os.replace(mine, raw_filename)

    return Stream
