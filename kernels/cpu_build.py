"""The C libraries of the CPU path (kernels/*.c), compiled at first use and loaded through ctypes.

Each source is compiled with the system C compiler (about 0.5 s) into megabam's cache ($MEGABAM_CACHE
or ~/.cache/megabam, folder cpu_kernels), one file per source (and the headers beside it), flags,
compiler, CPU and torch, written atomically, and linked to the OpenMP runtime torch has loaded (one
thread pool, with its denormal flush). Where no compiler works `load` returns None with a warning, and
kernels/dispatch.py keeps the PyTorch forms.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

# -ffast-math for glibc's vectorised exp (libmvec); at compile time only, so a library does not set
# the process's floating-point mode when loaded. No inf or NaN enters the C code (each source says how).
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
BUILD_TIMEOUT_S = 120

log = logging.getLogger(__name__)
P, I64, F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


def cache_folder() -> Path:
    return Path(os.environ.get("MEGABAM_CACHE") or "~/.cache/megabam").expanduser() / "cpu_kernels"


def cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and flags (a cache shared by several kinds of
    machine keeps one library per kind)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "\n" + "\n".join(dict.fromkeys(keep))


def build(source: Path, compiler: str, folder: Path) -> Path:
    """The compiled library of `source`, built now unless the cache holds it; raises on a failed build."""
    torch_lib = Path(torch.__file__).parent / "lib"
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    # A source includes headers from its own folder (#include "name.h" is looked up there first): their
    # text is part of the key, or an edited header would load the library built before the edit.
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    key = "\0".join([source.read_text(), *headers, " ".join(COMPILE_FLAGS), version, cpu_signature(), str(torch_lib)])
    target = folder / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: ranks building at once each write their own file, and
    # a reader never sees a half-written one.
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        obj, lib = Path(tmp) / f"{source.stem}.o", Path(tmp) / f"{source.stem}.so"
        # torch's own OpenMP runtime where it ships one (one thread pool), else the compiler's
        torch_gomp = (torch_lib / "libgomp.so.1").exists()
        link = ["-L", str(torch_lib), "-l:libgomp.so.1", f"-Wl,-rpath,{torch_lib}"] if torch_gomp else ["-fopenmp"]
        for cmd in (
            [compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
            [compiler, "-shared", "-o", str(lib), str(obj), *link, "-lmvec", "-lm"],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["no message"])[-1]
                raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}): {last}")
        os.replace(lib, target)
    return target


def load(source: Path, what: str, argtypes: dict[str, list]) -> ctypes.CDLL | None:
    """`source`'s library with the functions of `argtypes` declared, compiled on first use; None (and
    a warning naming `what` and why) where it cannot be built or loaded."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    try:
        if compiler is None:
            raise RuntimeError("no C compiler (cc, gcc or $CC) found")
        lib = ctypes.CDLL(str(build(source, compiler, cache_folder())))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("%s unavailable, using the PyTorch reference: %s", what, e)
        return None
    for name, types in argtypes.items():
        getattr(lib, name).argtypes = types
    return lib


def ptr(t: Tensor | None, offset: int = 0) -> int | None:
    """The address of element `offset` of t (NULL for None)."""
    return None if t is None else t.data_ptr() + offset * t.element_size()
