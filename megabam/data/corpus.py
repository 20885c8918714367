"""Real text that every machine has: the running Python's standard library sources."""

import os
import sysconfig
from pathlib import Path

# Directories left out: installed third-party packages (differ per machine) and test suites
# (large, repetitive, and full of deliberately odd text).
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def python_stdlib_documents(max_bytes: int) -> list[str]:
    """Return the stdlib's ``.py`` files as documents, one per file, in sorted path order.

    Files are taken in sorted relative-path order until the next one would push the total UTF-8
    size past ``max_bytes``; files that are not valid UTF-8 are skipped. The result is
    deterministic for a given Python installation.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    documents: list[str] = []
    total = 0
    for path in _sorted_py_files(root):
        try:
            data = path.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if total + len(data) > max_bytes:
            break
        documents.append(text)
        total += len(data)
    return documents


def _sorted_py_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())
