"""Documents from the inputs users bring: text, JSON Lines, gzip/zstd versions, MDS text shards.

An input spec is a file, a directory (searched recursively for known suffixes) or a glob. Plain
text files are one document each, or one per line; JSON Lines files hold one document per line
in a configurable field. An MDS directory (one holding ``index.json``) yields the field of each
sample. Non-UTF-8 bytes are replaced or refused (``on_bad_utf8``) and counted either way.
"""

import glob
import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megabam.data.errors import DataError

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd")


@dataclass
class SourceStats:
    """What reading the inputs met, for the summary."""

    files: int = 0
    documents: int = 0
    empty_skipped: int = 0
    bad_utf8: int = 0


def expand_inputs(specs: list[str]) -> list[Path]:
    """Files and MDS directories named by ``specs`` (paths, directories, globs), in sorted order.

    Raises DataError when a spec matches nothing or no input remains.
    """
    found: list[Path] = []
    for spec in specs:
        matches = [Path(p) for p in sorted(glob.glob(spec, recursive=True))] if glob.has_magic(spec) else [Path(spec)]
        matches = [p for p in matches if p.exists()]
        if not matches:
            raise DataError(f"input {spec!r} does not exist or matches nothing")
        for path in matches:
            if path.is_dir() and not (path / "index.json").exists():
                # MDS directories found inside are inputs of their own (their index.json is no JSON Lines).
                mds_dirs = {p.parent for p in path.rglob("index.json")}
                files = sorted(
                    p
                    for p in path.rglob("*")
                    if (p in mds_dirs) or (p.is_file() and _kind(p) is not None and not mds_dirs & set(p.parents))
                )
                if not files:
                    raise DataError(f"input directory {path} holds no .txt/.jsonl files (plain, .gz or .zst)")
                found.extend(files)
            elif path.is_dir() or _kind(path) is not None:
                found.append(path)
            else:
                raise DataError(f"input {path}: unknown file kind (expected .txt/.md/.jsonl/.json, plain, .gz or .zst)")
    return found


def read_documents(
    paths: list[Path],
    *,
    text_field: str = "text",
    text_unit: str = "file",
    on_bad_utf8: str = "fail",
    stats: SourceStats | None = None,
) -> Iterator[str]:
    """Yield every non-empty document of ``paths`` (from ``expand_inputs``) in order.

    ``text_unit`` is ``file`` (a plain text file is one document) or ``line``; ``on_bad_utf8`` is
    ``fail`` (DataError naming file and line) or ``replace`` (U+FFFD, counted in ``stats``).
    """
    if on_bad_utf8 not in ("fail", "replace"):
        raise ValueError(f"on_bad_utf8 must be 'fail' or 'replace', got {on_bad_utf8!r}")
    if text_unit not in ("file", "line"):
        raise ValueError(f"text_unit must be 'file' or 'line', got {text_unit!r}")
    stats = stats if stats is not None else SourceStats()
    for path in paths:
        stats.files += 1
        if path.is_dir():
            raw_docs = _mds_documents(path, text_field)
        elif _kind(path) == "jsonl":
            raw_docs = _jsonl_documents(path, text_field, on_bad_utf8, stats)
        else:
            raw_docs = _text_documents(path, text_unit, on_bad_utf8, stats)
        for text in raw_docs:
            if not text:
                stats.empty_skipped += 1
                continue
            stats.documents += 1
            yield text


def _kind(path: Path) -> str | None:
    name = path.name.lower()
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
                f"{where}: not valid UTF-8 (byte {e.start}); pass --on-bad-utf8 replace to keep it"
            ) from None
        stats.bad_utf8 += 1
        return data.decode("utf-8", errors="replace")


def _text_documents(path: Path, text_unit: str, on_bad_utf8: str, stats: SourceStats) -> Iterator[str]:
    with _open_binary(path) as f:
        try:
            if text_unit == "file":
                yield _decode(f.read(), str(path), on_bad_utf8, stats)
                return
            for n, line in enumerate(f, 1):
                yield _decode(line, f"{path}:{n}", on_bad_utf8, stats).rstrip("\r\n")
        except (OSError, EOFError) as e:  # truncated or corrupt compressed file
            raise DataError(f"{path}: cannot read ({e})") from None


def _jsonl_documents(path: Path, field: str, on_bad_utf8: str, stats: SourceStats) -> Iterator[str]:
    with _open_binary(path) as f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    record = json.loads(_decode(line, where, on_bad_utf8, stats))
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not a JSON object ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    raise DataError(f"{where}: no string field {field!r} (set it with --field)")
                yield record[field]
        except (OSError, EOFError) as e:
            raise DataError(f"{path}: cannot read ({e})") from None


def _mds_documents(path: Path, field: str) -> Iterator[str]:
    from megabam.data.shards import iter_mds_samples, read_index

    shards = read_index(path)["shards"]
    columns = shards[0]["column_names"] if shards else []
    if field not in columns:
        raise DataError(f"{path}: MDS shards have no column {field!r} (columns: {', '.join(columns) or 'none'})")
    for sample in iter_mds_samples(path):
        yield sample[field]
