"""The BAM attention kernels' instruction budget (tools/kernel_budget.py), compiled for an sm_90 GPU on
CPU: per score of the steady-state loop, the forward spends ≤ 1.1 special-function (MUFU) operations
with the prior on, within 10 % of the prior-off kernel (the prior is a table read, not a per-score
exp and log), each backward kernel ≤ 2.2, and no configuration any of them may autotune to spills
registers to local memory.

The tool runs in a subprocess: it must import the kernel module without TRITON_INTERPRET (the
interpreter's module declares one small config), which other test files set in-process, and it
compiles into a temporary cache of its own, so nothing is reused between runs. bf16 inputs, SSMax on,
the PAIRS below (GROUP > 1 compiles apart from GROUP = 1): 10 compiles, ~10 s on two cores. Every
autotune config of the kernel under test is the GPU's own list; the kernels' compile for sm_90 is
checked here too (what only the compiler rejects, e.g. a non-constexpr global).
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cuobjdump() -> str | None:
    # Found without importing triton: this runs at collection, and importing triton before a file
    # that sets TRITON_INTERPRET in-process (test_kernels_triton) would leave that file's kernels
    # compiled for the GPU.
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.access(path, os.X_OK) else None


pytestmark = pytest.mark.skipif(
    _cuobjdump() is None, reason="needs Triton's nvidia backend and the cuobjdump its wheel ships"
)


# Each kernel at every config it declares, with the prior (the one that fills registers); dk/dv with
# grouped-query attention too (its group loop wraps the query loop). The other pairs compile to less
# and are in the tool's full table (docs/benchmarks.md); 10 compiles instead of 24 keep the suite's
# time. The forward without the prior spends at least its softmax's one exp2 per score, so <= 1.1
# with the prior is within 10 % of it.
PAIRS = ["bam_fwd:prior", "bam_dkdv:prior", "bam_dkdv:prior gqa", "bam_dq:prior"]
VARIANTS = {"fwd_kernel": {"prior"}, "bwd_dkdv_kernel": {"prior", "prior gqa"}, "bwd_dq_kernel": {"prior"}}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("budget") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "tools/kernel_budget.py", "--kernels", "bam_fwd", "bam_dkdv", "bam_dq"]
    command += ["--arch", "90", "--dtypes", "bf16", "--jobs", "2", "--json", str(out), "--only", *PAIRS]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_autotune_config_compiles_without_spills(rows):
    assert not [r for r in rows if "error" in r]
    # Every config each kernel declares, with and without the prior: the GPU's list (several), not
    # the interpreter's one.
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"fwd_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"}
    for kernel in kernels:
        configs = {r["config"] for r in rows if r["kernel"] == kernel}
        assert len(configs) > 1, (kernel, configs)
        assert {(r["variant"], r["config"]) for r in rows if r["kernel"] == kernel} == {
            (v, c) for v in VARIANTS[kernel] for c in configs
        }
    spills = [(r["kernel"], r["variant"], r["config"], r["STL"], r["LDL"]) for r in rows if r["STL"] or r["LDL"]]
    assert not spills


def test_special_function_ops_per_score(rows):
    # Every row counts a loop (the kernels have one each), never the whole kernel.
    assert all(r["loop"] == "loop" for r in rows)
    mufu = {(r["kernel"], r["variant"], r["config"]): r["per"]["MUFU"] for r in rows}
    for (kernel, variant, config), per_score in mufu.items():
        if kernel == "fwd_kernel":
            assert per_score <= 1.1, (kernel, variant, config, per_score)
        else:
            assert per_score <= 2.2, (kernel, variant, config, per_score)
