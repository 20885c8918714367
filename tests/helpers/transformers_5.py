"""The side environment of the export tests: a venv with only CPU torch (this environment's version)
and the newest transformers 5.x release when the tests were written, kept in the user's cache and
built once. tests/e2e/test_hf_export.py builds it on first use, inside the suite's time; CI builds it
beforehand (`bash tools/install.sh --with-transformers-5`, in .ci/run), as it installs the suite's
other tools.

    python tests/helpers/transformers_5.py   # build it (if not built) and print its interpreter
"""

import fcntl
import os
import subprocess
import sys
from pathlib import Path

VERSION = "5.24.0"


def torch_version() -> str:
    # Read without importing torch (~1 s): install.sh runs this before anything needs torch loaded.
    from importlib.metadata import version

    return version("torch").split("+")[0]


def side_python() -> Path:
    """The side environment's interpreter, built first if missing. Installed by this environment's pip
    without compiling every module first (the side interpreter compiles what it imports): 41 -> 18 s
    on a fresh CI machine. Built under a lock: a second copy of the suite on the machine waits for
    the first's build instead of clearing the folder under it."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megabam" / f"transformers-{VERSION}"
    python = cache / "bin" / "python"
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f".{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cache / "complete").is_file():
            subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(cache)], check=True)
            pins = [f"torch=={torch_version()}", f"transformers=={VERSION}"]
            pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile"]
            subprocess.run([*pip, "--disable-pip-version-check", *pins], check=True, timeout=1200)
            (cache / "complete").write_text("")
    return python


if __name__ == "__main__":
    print(side_python())
