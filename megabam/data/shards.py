"""Writing packed samples as mosaicml-streaming MDS shards, and checking shards against their index."""

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from megabam.data.errors import DataError
from megabam.data.packing import PackedSample
from megabam.data.streaming_import import import_streaming
from megabam.progress import Progress
from megabam.staging import staged_name

COLUMNS = {"tokens": "ndarray:int32", "doc_starts": "ndarray:int32"}
HASHES = ["sha1"]
# The MDS column encodings megabam decodes: numbers, strings, bytes, JSON and numpy arrays, none of
# which runs code while decoding. Anything else is refused before a sample is read: above all `pkl`
# (a pickle: a crafted sample runs code when decoded), and the image codecs megabam never writes.
SAFE_ENCODINGS = frozenset(
    ["bytes", "str", "str_int", "str_float", "str_decimal", "json", "int", "float16", "float32", "float64"]
    + [f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64)]
)


def is_safe_encoding(encoding: str) -> bool:
    """Whether megabam decodes an MDS column of this encoding (ndarray with or without dtype/shape)."""
    return encoding in SAFE_ENCODINGS or encoding.split(":")[0] == "ndarray"


def check_columns(where: str, names, encodings) -> None:
    """Refuse (DataError naming `where` and the column) a shard with a column megabam will not decode."""
    for name, encoding in zip(names, encodings):
        if not isinstance(encoding, str) or not is_safe_encoding(encoding):
            raise DataError(
                where,
                None,
                f"column {name!r} has encoding {encoding!r}, which megabam does not decode "
                "(pickles and images are refused; allowed: numbers, str, bytes, json, ndarray)",
            )


def open_mds_writer(out_dir: str | os.PathLike, compression: str | None = "zstd", size_limit: int | str = "8mb"):
    """An ``MDSWriter`` for packed samples (``tokens``, ``doc_starts``) with sha1 hashes."""
    return import_streaming().MDSWriter(
        out=str(out_dir), columns=COLUMNS, compression=compression, hashes=HASHES, size_limit=size_limit
    )


def write_sample(writer, sample: PackedSample) -> None:
    """Write one packed sample through a writer from ``open_mds_writer``."""
    writer.write({"tokens": sample.tokens, "doc_starts": sample.doc_starts})


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
    tmp_dir = staged_name(out_dir)
    writer = open_mds_writer(tmp_dir, compression, size_limit)
    count = 0
    try:
        for sample in samples:
            write_sample(writer, sample)
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


def read_index(mds_dir: str | os.PathLike) -> dict:
    """The parsed ``index.json`` of an MDS directory, checked before any shard is read: the shape
    megabam relies on, MDS shards only, and every column's encoding safe to decode (DataError naming
    the file otherwise). Every reader of shards megabam did not write starts here."""
    path = Path(mds_dir) / "index.json"
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(mds_dir, None, "not an MDS dataset (no index.json)") from None
    except (OSError, ValueError) as e:
        raise DataError(path, None, f"unreadable index ({e})") from None
    shards = index.get("shards") if isinstance(index, dict) else None
    if not isinstance(shards, list):
        raise DataError(path, None, "not an MDS index (expected an object with a list of shards)")
    for i, shard in enumerate(shards):
        where = f"{path}: shard {i}"
        if not isinstance(shard, dict) or shard.get("format") != "mds":
            kind = shard.get("format") if isinstance(shard, dict) else type(shard).__name__
            raise DataError(where, None, f"format {kind!r} is not MDS (megabam reads MDS shards only)")
        raw, zipped = shard.get("raw_data"), shard.get("zip_data")
        names, encodings = shard.get("column_names"), shard.get("column_encodings")
        if not (
            isinstance(raw, dict)
            and isinstance(raw.get("basename"), str)
            and isinstance(raw.get("bytes"), int)
            and (zipped is None or (isinstance(zipped, dict) and isinstance(zipped.get("basename"), str)))
            and isinstance(shard.get("samples"), int)
            and isinstance(names, list)
            and isinstance(encodings, list)
            and len(names) == len(encodings)
        ):
            raise DataError(
                where, None, "malformed entry (raw_data, zip_data, samples, column_names, column_encodings)"
            )
        for name in (raw["basename"], zipped["basename"] if zipped else "x"):
            if not _inside(name):
                raise DataError(where, None, f"shard file name {name!r} points outside the dataset")
        check_columns(f"{where} ({raw['basename']})", names, encodings)
    return index


def _inside(basename: str) -> bool:
    """A shard path within the dataset: a file name, or a part's folder and a file name (streaming's
    index merge writes ``PART/shard.NNNNN.mds``), no component hidden, empty or parent."""
    parts = basename.split("/")
    return len(parts) <= 2 and all(p and not p.startswith(".") and "\\" not in p for p in parts)


def verify_shards(mds_dir: str | os.PathLike, hashes: bool = True, desc: str | None = None) -> int:
    """Check every shard file of ``mds_dir`` against the size and hashes in its index.

    Checks the compressed file when the raw one is absent (as written), the raw one otherwise;
    ``hashes=False`` checks sizes only, without reading the files. Returns the number of shards;
    raises DataError at the first missing, truncated or corrupted one. ``desc`` names the progress
    (megabam/progress.py) of the bytes hashed.
    """
    mds_dir = Path(mds_dir)
    shards = read_index(mds_dir)["shards"]
    files = []
    for shard in shards:
        info = shard["raw_data"]
        if not (mds_dir / info["basename"]).exists() and shard.get("zip_data"):
            info = shard["zip_data"]
        files.append(info)
    total = sum(info["bytes"] for info in files)
    with Progress(desc or "", total, "B", binary=True, enabled=hashes and desc is not None) as report:
        for info in files:
            _verify_file(mds_dir, info, hashes)
            report.advance(info["bytes"])
    return len(shards)


def _verify_file(mds_dir: Path, info: dict, hashes: bool) -> None:
    """One shard file (raw or compressed, ``info`` its entry in the index) against its size and hashes."""
    path = mds_dir / info["basename"]
    try:
        size = path.stat().st_size
    except OSError:
        raise DataError(path, None, "shard file missing") from None
    if size != info["bytes"]:
        raise DataError(path, None, f"shard truncated or corrupted ({size} bytes, index says {info['bytes']})")
    if not hashes:
        return
    data = path.read_bytes()
    for algo, want in info.get("hashes", {}).items():
        if algo in hashlib.algorithms_available and hashlib.new(algo, data).hexdigest() != want:
            raise DataError(path, None, f"shard corrupted ({algo} hash mismatch)")


@contextlib.contextmanager
def _undecodable(path: Path, what: str):
    """Bytes of a shard's right size (and, its index re-signed, hash) that are no shard: whatever the
    decoder raises becomes one line naming the file."""
    try:
        yield
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            path, None, f"not a readable MDS shard, cannot be {what} ({type(e).__name__}: {e})"[:300]
        ) from None


def iter_mds_samples(mds_dir: str | os.PathLike, limit: int | None = None) -> Iterator[dict]:
    """The samples of ``mds_dir`` in order (at most ``limit``), compressed shards included.

    Reads the dataset in place without streaming's shared-memory machinery; a compressed shard is
    decompressed into a temporary directory one at a time, so the dataset directory is never
    modified and memory holds one shard.
    """
    mds_dir = Path(mds_dir)
    import_streaming()  # registers its stand-ins before streaming.base is first imported
    from streaming.base.compression import decompress
    from streaming.base.format import reader_from_json

    count = 0
    with tempfile.TemporaryDirectory(prefix="megabam-mds-") as tmp:
        for shard in read_index(mds_dir)["shards"]:
            raw = shard["raw_data"]["basename"]
            where = mds_dir
            if not (mds_dir / raw).exists():
                if not shard.get("zip_data"):
                    raise DataError(mds_dir / raw, None, "shard file missing")
                data = (mds_dir / shard["zip_data"]["basename"]).read_bytes()
                (Path(tmp) / raw).parent.mkdir(parents=True, exist_ok=True)
                with _undecodable(mds_dir / shard["zip_data"]["basename"], "decompressed"):
                    (Path(tmp) / raw).write_bytes(decompress(shard["compression"], data))
                where = Path(tmp)
            reader = reader_from_json(str(where), None, shard)
            for i in range(reader.samples):
                if limit is not None and count >= limit:
                    return
                with _undecodable(mds_dir / raw, f"read at sample {i}"):
                    item = reader.get_item(i)
                yield item
                count += 1
            if where != mds_dir:
                (Path(tmp) / raw).unlink()
