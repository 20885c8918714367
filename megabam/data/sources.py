"""Documents from the inputs users bring: text, JSON Lines, gzip/zstd versions, Parquet, Arrow IPC,
Hugging Face ``datasets`` folders and MDS text shards.

An input spec is a file, a directory (searched recursively for known suffixes) or a glob. Plain
text files are one document each, or one per line; JSON Lines files hold one document per line
in a configurable field, and so do the rows of Parquet and Arrow files (read a record batch at a
time: memory is bounded by a batch, not a file). An MDS directory (one holding ``index.json``)
yields the field of each sample. A ``datasets`` folder (``save_to_disk``'s ``state.json`` /
``dataset_dict.json``, or a hub download's ``data/`` of Parquet files) yields its data files only
(its metadata is never read as JSON Lines, its README never as text), of one split where it has
several. Non-UTF-8 bytes are replaced or refused (``on_bad_utf8``) and counted either way.

A large file is read in pieces that processes read apart (``pieces``, then ``read_documents(span=)``):
a line-based file between byte offsets (a line belongs to the piece its first byte lies in, so the
pieces read each line once), Parquet between row groups, an Arrow IPC file between record batches.
"""

import glob
import gzip
import io
import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megabam.data.errors import DataError

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd")
PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
# What `datasets` writes beside its data: never documents.
HF_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json", "dataset_infos.json")
# A hub dataset's data files are named SPLIT-00000-of-00004.parquet (or sit in a folder per split).
HF_SHARD_NAME = re.compile(r"^(?P<split>[A-Za-z0-9_.]+?)-\d{5}-of-\d{5}")
BATCH_ROWS = 1024  # rows per Arrow record batch read from Parquet: bounded memory, amortised calls


@dataclass
class SourceStats:
    """What reading the inputs met, for the summary."""

    files: int = 0
    documents: int = 0
    empty_skipped: int = 0
    bad_utf8: int = 0


def expand_inputs(specs: list[str], hf_split: str = "train") -> list[Path]:
    """Files and MDS directories named by ``specs`` (paths, directories, globs), in sorted order.

    A Hugging Face ``datasets`` folder gives its data files in its own order, of split ``hf_split``
    where it holds several. Raises DataError when a spec matches nothing or no input remains.
    """
    found: list[Path] = []
    for spec in specs:
        matches = [Path(p) for p in sorted(glob.glob(spec, recursive=True))] if glob.has_magic(spec) else [Path(spec)]
        matches = [p for p in matches if p.exists()]
        if not matches:
            raise DataError(spec, None, "does not exist or matches nothing")
        for path in matches:
            if path.is_dir() and _is_hf_dataset(path):
                found.extend(_hf_data_files(path, hf_split))
            elif path.is_dir() and not (path / "index.json").exists():
                # MDS and `datasets` folders found inside are inputs of their own (an index.json or a
                # dataset_info.json is no JSON Lines, a dataset card no text document).
                mds_dirs = {p.parent for p in path.rglob("index.json")}
                hf_dirs = {p for p in path.rglob("*") if p.is_dir() and _is_hf_dataset(p)}
                folders = mds_dirs | hf_dirs
                entries = sorted(
                    p
                    for p in path.rglob("*")
                    if (p in folders or (p.is_file() and _kind(p) is not None)) and not folders & set(p.parents)
                )
                files = [f for p in entries for f in (_hf_data_files(p, hf_split) if p in hf_dirs else [p])]
                if not files:
                    raise DataError(
                        path, None, "a directory without .txt/.jsonl (plain, .gz or .zst), .parquet or .arrow files"
                    )
                found.extend(files)
            elif path.is_dir() or _kind(path) is not None:
                found.append(path)
            else:
                raise DataError(
                    path,
                    None,
                    "unknown file kind (expected .txt/.md/.jsonl/.json, plain, .gz or .zst; .parquet; .arrow)",
                )
    return found


def _is_hf_dataset(path: Path) -> bool:
    """A folder `datasets` wrote (save_to_disk) or a hub dataset's download (README.md beside data/)."""
    if any((path / name).is_file() for name in ("state.json", "dataset_dict.json")):
        return True
    return (path / "README.md").is_file() and (path / "data").is_dir()


def read_json_object(path: Path) -> dict:
    """A JSON file holding an object, or DataError naming the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(path, None, f"not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise DataError(path, None, "not a JSON object")
    return data


def _hf_data_files(folder: Path, split: str) -> list[Path]:
    """The data files of a `datasets` folder, in the dataset's own order (split `split` of several)."""
    if (folder / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: a Dataset folder per split
        splits = read_json_object(folder / "dataset_dict.json").get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise DataError(folder / "dataset_dict.json", None, "no list of splits")
        if split not in splits:
            raise DataError(
                folder, None, f"no split {split!r} (splits: {', '.join(splits)}; choose one with --hf-split)"
            )
        return _hf_data_files(folder / split, split)
    if (folder / "state.json").is_file():  # Dataset.save_to_disk: state.json lists its Arrow files in order
        files = read_json_object(folder / "state.json").get("_data_files")
        if not isinstance(files, list) or not all(isinstance(f, dict) and "filename" in f for f in files):
            raise DataError(folder / "state.json", None, "no list of data files (_data_files)")
        paths = [folder / f["filename"] for f in files]
        for path in paths:
            if path.parent != folder or not path.is_file():
                raise DataError(folder / "state.json", None, f"names {path.name!r}, which is not a file in {folder}")
        return paths
    # A hub download: Parquet/Arrow files under data/, of one split where their names say several.
    files = sorted(p for p in (folder / "data").rglob("*") if p.is_file() and _kind(p) in ("parquet", "arrow"))
    if not files:
        raise DataError(folder, None, "a Hugging Face dataset folder with no .parquet or .arrow files under data/")
    named = [HF_SHARD_NAME.match(p.name) for p in files]
    if not all(named):
        return files  # files not named by split (FineWeb's data/CC-MAIN-*/000_00000.parquet): all of them
    splits = sorted({m["split"] for m in named})
    if split not in splits:
        raise DataError(folder, None, f"no split {split!r} (splits: {', '.join(splits)}; choose one with --hf-split)")
    return [p for p, m in zip(files, named) if m["split"] == split]


def read_documents(
    paths: list[Path],
    *,
    text_field: str = "text",
    text_unit: str = "file",
    on_bad_utf8: str = "fail",
    stats: SourceStats | None = None,
    span: list[int] | None = None,
) -> Iterator[str]:
    """Yield every non-empty document of ``paths`` (from ``expand_inputs``) in order.

    ``text_unit`` is ``file`` (a plain text file is one document) or ``line``; ``on_bad_utf8`` is
    ``fail`` (DataError naming file and line) or ``replace`` (U+FFFD, counted in ``stats``). ``span``,
    from ``pieces`` for the one path given, reads that piece of it only.
    """
    if span is not None and len(paths) != 1:
        raise ValueError("a span is a piece of one file")
    if on_bad_utf8 not in ("fail", "replace"):
        raise ValueError(f"on_bad_utf8 must be 'fail' or 'replace', got {on_bad_utf8!r}")
    if text_unit not in ("file", "line"):
        raise ValueError(f"text_unit must be 'file' or 'line', got {text_unit!r}")
    stats = stats if stats is not None else SourceStats()
    for path in paths:
        stats.files += 1
        if path.is_dir():
            raw_docs = _mds_documents(path, text_field)
        elif _kind(path) in ("parquet", "arrow"):
            raw_docs = _columnar_documents(path, text_field, span)
        elif _kind(path) == "jsonl":
            raw_docs = _jsonl_documents(path, text_field, on_bad_utf8, stats, span)
        else:
            raw_docs = _text_documents(path, text_unit, on_bad_utf8, stats, span)
        for text in raw_docs:
            if not text:
                stats.empty_skipped += 1
                continue
            stats.documents += 1
            yield text


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name in HF_METADATA:
        return None
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(ARROW_SUFFIXES):
        return "arrow"
    for suffix in COMPRESSED_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def _open_binary(path: Path) -> io.BufferedIOBase:
    """The decompressed byte stream of ``path`` (read incrementally, never whole)."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith((".zst", ".zstd")):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _decode(data: bytes, where: str, on_bad_utf8: str, stats: SourceStats) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if on_bad_utf8 == "fail":
            raise DataError(
                where, None, f"not valid UTF-8 (byte {e.start}); pass --on-bad-utf8 replace to keep it"
            ) from None
        stats.bad_utf8 += 1
        return data.decode("utf-8", errors="replace")


def _lines(f, path: Path, span: list[int] | None) -> Iterator[tuple[str, bytes]]:
    """(where, line) for the lines of an open file, or for those that begin inside ``span`` = [start,
    end) bytes: the line running across ``start`` belongs to the piece before."""
    start, end = span if span is not None else (0, None)
    if start > 0:
        f.seek(start - 1)
        f.readline()  # the rest of the line holding byte start - 1 (just its newline, if it ends there)
    at, n = f.tell(), 0
    while end is None or at < end:
        line = f.readline()
        if not line:
            return
        n += 1
        yield (f"{path}:{n}" if start == 0 else f"{path} (the line at byte {at:,})"), line
        at += len(line)


def _text_documents(
    path: Path, text_unit: str, on_bad_utf8: str, stats: SourceStats, span: list[int] | None
) -> Iterator[str]:
    with _open_binary(path) as f:
        try:
            if text_unit == "file":
                yield _decode(f.read(), str(path), on_bad_utf8, stats)
                return
            for where, line in _lines(f, path, span):
                yield _decode(line, where, on_bad_utf8, stats).rstrip("\r\n")
        except (OSError, EOFError) as e:  # truncated or corrupt compressed file
            raise DataError(path, None, f"cannot read ({e})") from None


def _jsonl_documents(
    path: Path, field: str, on_bad_utf8: str, stats: SourceStats, span: list[int] | None
) -> Iterator[str]:
    with _open_binary(path) as f:
        try:
            for where, line in _lines(f, path, span):
                if not line.strip():
                    continue
                try:
                    record = json.loads(_decode(line, where, on_bad_utf8, stats))
                except json.JSONDecodeError as e:
                    raise DataError(where, None, f"not a JSON object ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    raise DataError(where, None, f"no string field {field!r} (set it with --field)")
                yield record[field]
        except (OSError, EOFError) as e:
            raise DataError(path, None, f"cannot read ({e})") from None


def _record_batches(path: Path, field: str, span: list[int] | None):
    """(column names, record batches of column `field`) of a Parquet or Arrow IPC file, read lazily;
    with ``span``, of row groups (Parquet) or record batches (Arrow) [start, end) only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if _kind(path) == "parquet":
        f = pq.ParquetFile(path)
        names = f.schema_arrow.names
        groups = range(*span) if span is not None else None
        batches = f.iter_batches(batch_size=BATCH_ROWS, columns=[field], row_groups=groups)
        return names, batches if field in names else iter(())
    source = pa.memory_map(str(path))  # pages in what a batch touches, never the file at once
    try:
        reader = pa.ipc.open_file(source)  # the IPC file format (.arrow / Feather 2)
        batches = (reader.get_batch(i) for i in range(*(span or (reader.num_record_batches,))))
    except pa.ArrowInvalid:
        source.seek(0)
        reader = pa.ipc.open_stream(source)  # the stream format, which `datasets` writes
        batches = iter(reader)
    names = reader.schema.names
    return names, (b.select([field]) for b in batches) if field in names else iter(())


def _unreadable(path: Path, e: Exception) -> DataError:
    return DataError(path, None, f"cannot read as {_kind(path)} ({str(e).splitlines()[0]})")


def _columnar_documents(path: Path, field: str, span: list[int] | None) -> Iterator[str]:
    import pyarrow as pa

    try:
        names, batches = _record_batches(path, field, span)
        if field not in names:
            raise DataError(
                path, None, f"no column {field!r} (columns: {', '.join(names) or 'none'}; set it with --field)"
            )
        for batch in batches:
            column = batch.column(0)
            if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
                raise DataError(path, None, f"column {field!r} holds {column.type}, not text")
            for text in column.to_pylist():
                yield text or ""  # a null is an empty document: skipped and counted
    except (pa.ArrowException, OSError) as e:  # corrupt or truncated file
        raise _unreadable(path, e) from None


def consecutive_groups(sizes: list[int], target: int) -> list[list[int]]:
    """The indexes of ``sizes`` in consecutive groups of at most ``target`` in all (an item larger than
    ``target`` alone): how files are put together into tasks, and row groups or batches into pieces."""
    groups, total = [], 0
    for i, size in enumerate(sizes):
        if groups and total + size <= target:
            groups[-1].append(i)
            total += size
        else:
            groups.append([i])
            total = size
    return groups


def pieces(path: Path, size: int, text_unit: str, target: int) -> list[tuple[list[int] | None, int]]:
    """``path`` (of ``size`` bytes) cut into pieces of about ``target`` bytes, as [(span, bytes)] for
    ``read_documents(span=)``; [(None, size)] where it is not cut: a file under ``target``, a compressed
    one (no seeking), a text file read whole, an Arrow stream, an MDS folder, a single row group."""
    kind = None if path.is_dir() else _kind(path)
    compressed = path.name.lower().endswith(COMPRESSED_SUFFIXES)
    if size <= target or kind is None or compressed or (kind == "text" and text_unit == "file"):
        return [(None, size)]
    if kind in ("jsonl", "text"):  # byte offsets; the reader moves each cut to a line start
        n = -(-size // target)
        return [([size * i // n, size * (i + 1) // n], size * (i + 1) // n - size * i // n) for i in range(n)]
    import pyarrow as pa

    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            unit_bytes = [
                sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns))
                for g in range(meta.num_row_groups)
            ]
        else:
            try:
                batches = pa.ipc.open_file(pa.memory_map(str(path))).num_record_batches
            except pa.ArrowInvalid:  # the stream format: no index of its batches to seek by
                return [(None, size)]
            unit_bytes = [size // max(batches, 1)] * batches
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(path, e) from None
    cuts = [([g[0], g[-1] + 1], sum(unit_bytes[i] for i in g)) for g in consecutive_groups(unit_bytes, target)]
    if len(cuts) <= 1:
        return [(None, size)]
    # Progress counts file bytes: share the file's size out by the pieces' own sizes.
    total = sum(n for _, n in cuts) or 1
    ends = [size * n // total for n in itertools.accumulate(n for _, n in cuts)]
    return [(span, end - begin) for (span, _), begin, end in zip(cuts, [0] + ends[:-1], ends)]


def _mds_documents(path: Path, field: str) -> Iterator[str]:
    from megabam.data.shards import iter_mds_samples, read_index

    shards = read_index(path)["shards"]
    columns = shards[0]["column_names"] if shards else []
    if field not in columns:
        raise DataError(path, None, f"MDS shards have no column {field!r} (columns: {', '.join(columns) or 'none'})")
    for sample in iter_mds_samples(path):
        yield sample[field]
