"""The instruction budget of megabam's Triton kernels, read from their machine code, no GPU needed.

    python tools/kernel_budget.py                      # every kernel, every autotune config, sm_90 and sm_100
    python tools/kernel_budget.py --kernels bam_fwd --arch 90 --json budget.json

Each kernel is compiled at every autotune configuration it declares, for the GPU (Triton's nvidia
backend and the ptxas its wheel ships; no device is touched), and its SASS (the wheel's cuobjdump)
is counted. How the compile gets its arguments: the module's own host function (forward /
backward) runs on CPU tensors of a training shape with each autotuned kernel's launch replaced by a
recorder, and each recorded launch goes through the JIT's own argument path (binder, _pack_args),
so the compile sees what a real launch specialises (pointer alignment, strides of 1, sizes divisible
by 16). The module is imported with TRITON_INTERPRET unset: under the interpreter it declares one
small config, not the GPU's.

The steady-state loop: in cuobjdump's SASS a loop is a backward branch (`BRA` to a lower address);
its body is the instructions from the branch target to the branch. The main loop is the loop with
the most tensor-core instructions (HGMMA, HMMA, tcgen05's UTC*MMA), the innermost one on a tie (a
nested loop's body is inside its parent's, so the parent never has fewer); kernels whose dot
products are not on tensor cores (fp32 inputs) rank loops by FFMA instead. A kernel with no such
loop (the mLSTM forward chunk kernel: one chunk per program) is counted whole. Counts are divided by
the elements one loop iteration (or program) computes per thread, BLOCK_M·BLOCK_N / (32·num_warps)
for attention's score tiles; `unit` says which elements (unit_of). Spills (STL, LDL) and registers
are the whole kernel's. On sm_100 the loop found may hold a pipelined body twice (SM100_NOTE): its
per-element counts are not one iteration's there.
"""

import argparse
import importlib.util
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

# Before Triton is imported: the GPU configs (not the interpreter's), fp fusion as Triton 3.6 does it
# by default (3.9 warns that its default will change), and a compile cache of this run's own.
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
CACHE = tempfile.TemporaryDirectory(prefix="kernel-budget-")
os.environ["TRITON_CACHE_DIR"] = CACHE.name

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# SASS opcode classes (the opcode's first dotted part, or a prefix for families).
TENSOR_CORE = ("HGMMA", "HMMA", "UTCHMMA", "UTCQMMA", "UTCOMMA", "UTCMMA")
SHARED_LOADS = ("LDS", "LDSM")
GLOBAL_LOADS = ("LDG", "LDGSTS", "UTMALDG")
COLUMNS = ("MUFU", "FFMA", "FMUL", "FADD", "TC", "LDS", "LDG")
# Attention at a training shape: D 128, N a multiple of every tile (what the runtime specialises on).
BAM_SHAPE = dict(B=1, H=4, N=4096, D=128)
MLSTM_SHAPE = dict(B=1, H=2, N=4096, DQK=128, DV=256, CHUNK=64)  # docs/benchmarks.md's mLSTM shape


@dataclass(frozen=True)
class Launch:
    """One recorded launch: the autotuned kernel's attribute name, a variant label, its arguments."""

    kernel: str
    variant: str
    args: tuple
    kwargs: dict


def record(module, names, host):
    """The launches `host()` makes of module's autotuned kernels `names`, without running them."""
    calls = []

    def recorder(name):
        def run(*args, grid, warmup, **kwargs):
            calls.append((name, args, kwargs))

        return run

    for name in names:
        getattr(module, name).run = recorder(name)
    try:
        host()
    finally:
        for name in names:
            del getattr(module, name).run
    return calls


BAM_VARIANTS = ("prior", "no prior", "prior gqa")


def bam_launches(module, dtype, variant):
    """fwd_kernel, bwd_dkdv_kernel and bwd_dq_kernel as BAM_SHAPE's forward and backward launch them:
    SSMax on (after the prior), with the prior ("prior") or without ("no prior"), θμ trained; "prior
    gqa" with 4 query heads per key/value head (GROUP > 1 is compiled apart: a launch argument of 1
    is specialised away)."""
    B, H, N, D = BAM_SHAPE.values()
    q, dout = (torch.zeros(B, H, N, D, dtype=dtype) for _ in range(2))
    k, v = (torch.zeros(B, H // 4 if variant.endswith("gqa") else H, N, D, dtype=dtype) for _ in range(2))
    prior = variant.startswith("prior")
    heads = (torch.full((H,), -2.0), torch.ones(H), torch.full((H,), 0.1)) if prior else (None,) * 3
    s = torch.ones(H)
    lo, last = module.key_bounds(None, None, N, q.device)
    out = torch.zeros(B, H, N, D)
    stats = torch.zeros(B, H, N, 2)
    top = torch.zeros(B, H, N, dtype=torch.int32)
    grads = [torch.zeros_like(t) for t in (q, k, v)]

    def host():
        module.forward(q, k, v, lo, *heads, s, False, D**-0.5, out, stats, top)
        module.backward(q, k, v, out, dout, stats, top, lo, last, *heads, s, False, D**-0.5, *grads)

    names = ("fwd_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel")
    return [Launch(name, variant, args, kwargs) for name, args, kwargs in record(module, names, host)]


def mlstm_launches(module, dtype):
    """The four mLSTM kernels as MLSTM_SHAPE's forward and backward launch them (no initial state)."""
    B, H, N, DQK, DV, CHUNK = MLSTM_SHAPE.values()
    q, k = (torch.zeros(B, H, N, DQK, dtype=dtype) for _ in range(2))
    v, dh = (torch.zeros(B, H, N, DV, dtype=dtype) for _ in range(2))
    b, i, rows = (torch.zeros(B, H, N) for _ in range(3))
    m0 = torch.full((B, H), float("-inf"))

    def host():
        _, states, _, _ = module.forward(q, k, v, b, i, None, None, m0, 1e-6, CHUNK)
        module.backward(q, k, v, b, i, states, rows, rows, rows, dh, None, None, torch.zeros(B, H), CHUNK)

    names = ("fwd_state_kernel", "fwd_chunk_kernel", "bwd_state_kernel", "bwd_chunk_kernel")
    return [Launch(name, "", args, kwargs) for name, args, kwargs in record(module, names, host)]


def unit_of(launch: Launch, config) -> tuple[str, int]:
    """What one iteration of the main loop (or one program, without a loop) computes, and how many
    elements: attention's score tile; the mLSTM forward chunk kernel's chunk × chunk scores (no
    loop), its backward chunk kernel's chunk × BLOCK_DV tile (its loop runs over d_v tiles), the state
    kernels' d_qk × BLOCK_DV state tile (their loop runs over chunks)."""
    kw = {**launch.kwargs, **config.kwargs}
    if "BLOCK_M" in kw:
        return "score", kw["BLOCK_M"] * kw["BLOCK_N"]
    if launch.kernel == "fwd_chunk_kernel":
        return "score", kw["BLOCK_L"] ** 2
    if launch.kernel == "bwd_chunk_kernel":
        return "dv tile", kw["BLOCK_L"] * kw["BLOCK_DV"]
    return "state", kw["BLOCK_DQK"] * kw["BLOCK_DV"]


def configs_of(tuner, launch: Launch):
    """The autotune configs the kernel declares, after its own pruning for these arguments."""
    configs = tuner.configs
    if tuner.early_config_prune:
        named = dict(zip(tuner.arg_names, launch.args))
        configs = tuner.early_config_prune(configs, named, **launch.kwargs)
    return configs


def compile_launch(tuner, launch: Launch, config, arch: int):
    """The CompiledKernel a launch with `config` would build on an sm_`arch` GPU."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    fn = tuner.fn
    kwargs = {**launch.kwargs, **config.all_kwargs()}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def nvidia_tool(name: str) -> str:
    """A binary the Triton wheel ships (cuobjdump, nvdisasm)."""
    import triton.backends.nvidia as nvidia

    return os.path.join(os.path.dirname(nvidia.__file__), "bin", name)


INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def disassemble(cubin: bytes) -> tuple[list[tuple[int, str, str]], dict]:
    """(address, opcode, operands) of every SASS instruction, and the resource usage (REG, LOCAL, ...)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvidia_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True)
        res = subprocess.run(
            [nvidia_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True
        )
    instrs = [(int(m[1], 16), m[2], m[3]) for m in map(INSTRUCTION.match, sass.stdout.splitlines()) if m]
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", res.stdout)}
    return instrs, usage


def opclass(opcode: str, family: tuple[str, ...]) -> bool:
    return opcode.split(".")[0] in family


def main_loop(instrs) -> tuple[int, int] | None:
    """(first, last) instruction index of the steady-state loop (see the module docstring), or None."""
    at = {addr: n for n, (addr, _, _) in enumerate(instrs)}
    loops = []
    for n, (addr, op, operands) in enumerate(instrs):
        target = re.match(r"\s*(0x[0-9a-f]+)", operands)
        if op.split(".")[0] == "BRA" and target and int(target[1], 16) < addr:
            loops.append((at[int(target[1], 16)], n))

    def work(loop, family):
        return sum(opclass(op, family) for _, op, _ in instrs[loop[0] : loop[1] + 1])

    for family in (TENSOR_CORE, ("FFMA",)):
        most = max((work(loop, family) for loop in loops), default=0)
        if most:
            return min((loop for loop in loops if work(loop, family) == most), key=lambda loop: loop[1] - loop[0])
    return None


def budget(instrs, usage) -> dict:
    """Counts in the main loop (or the whole kernel without one), spills and registers of the whole."""
    loop = main_loop(instrs)
    body = instrs[loop[0] : loop[1] + 1] if loop else instrs
    ops = [op for _, op, _ in body]
    counts = {
        "MUFU": sum(op.startswith("MUFU") for op in ops),
        "FFMA": sum(opclass(op, ("FFMA",)) for op in ops),
        "FMUL": sum(opclass(op, ("FMUL",)) for op in ops),
        "FADD": sum(opclass(op, ("FADD",)) for op in ops),
        "TC": sum(opclass(op, TENSOR_CORE) for op in ops),
        "LDS": sum(opclass(op, SHARED_LOADS) for op in ops),
        "LDG": sum(opclass(op, GLOBAL_LOADS) for op in ops),
    }
    return dict(
        counts=counts,
        loop="loop" if loop else "whole",
        loop_len=len(body),
        STL=sum(opclass(op, ("STL",)) for _, op, _ in instrs),
        LDL=sum(opclass(op, ("LDL",)) for _, op, _ in instrs),
        REG=usage.get("REG", 0),
    )


# Filled in the parent before the worker processes fork: (module, launch, config, arch, dtype) per key.
JOBS: dict = {}


def run_job(key):
    """One row of the table: job `key`'s kernel compiled and counted, or the compile's error."""
    module, launch, config, arch, dtype = JOBS[key]
    tuner = getattr(module, launch.kernel)
    unit, elements = unit_of(launch, config)
    per_thread = elements / (32 * config.num_warps)
    row = dict(
        kernel=launch.kernel,
        variant=launch.variant,
        config=config_label(config),
        dtype=dtype,
        arch=f"sm_{arch}",
        unit=unit,
        per_thread=per_thread,
    )
    try:
        kernel = compile_launch(tuner, launch, config, arch)
    except Exception as e:  # noqa: BLE001 - reported per row (e.g. a ptxas without this arch)
        return {**row, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"}
    b = budget(*disassemble(kernel.asm["cubin"]))
    b["per"] = {name: count / per_thread for name, count in b.pop("counts").items()}
    return {**row, **b}


def config_label(config) -> str:
    kw = config.kwargs
    tile = f"{kw['BLOCK_M']}x{kw['BLOCK_N']}" if "BLOCK_M" in kw else f"DV {kw['BLOCK_DV']}"
    return f"{tile} w{config.num_warps} s{config.num_stages}"


def load_module(name: str, path: str | None):
    """The kernel module `name`, or the file `path` in its place (e.g. an older copy to compare)."""
    if path is None:
        module = importlib.import_module(name)
    else:
        spec = importlib.util.spec_from_file_location(name + "_budget", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    if module.INTERPRET:
        raise SystemExit(f"{name} was imported under TRITON_INTERPRET=1: it declares only the interpreter's config")
    return module


def table(rows) -> str:
    """The rows as one Markdown table (counts per unit element per thread; spills for the kernel)."""
    head = ["kernel", "variant", "config", "dtype", "arch", "unit", "/thread", *COLUMNS, "STL", "LDL", "REG"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["kernel"], r["variant"], r["config"], r["dtype"], r["arch"], r["unit"], f"{r['per_thread']:g}"]
        if "error" in r:
            cells += [f"not compiled: {r['error']}"] + [""] * (len(COLUMNS) + 2)
        else:
            cells += [f"{r['per'][c]:.2f}" for c in COLUMNS] + [str(r["STL"]), str(r["LDL"]), str(r["REG"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Measured (Triton 3.9): the Blackwell lowering lays loops out differently, e.g. a pipelined loop's body
# emitted twice (fwd_kernel 128x128 w8 s3: 130 ex2 in its PTX against sm_90's 66), held whole by the
# loop found.
SM100_NOTE = (
    "sm_100: the loop found may hold more than one copy of an iteration (Triton's Blackwell lowering "
    "emits pipelined bodies twice), so its per-element counts are not comparable with sm_90's; spills "
    "and registers are the kernel's."
)
KERNELS = {
    "bam_fwd": "fwd_kernel",
    "bam_dkdv": "bwd_dkdv_kernel",
    "bam_dq": "bwd_dq_kernel",
    "mlstm": None,  # all four
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    ap.add_argument("--variants", nargs="+", choices=BAM_VARIANTS, default=list(BAM_VARIANTS))
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["bf16"])
    ap.add_argument("--arch", nargs="+", type=int, default=[90, 100], help="sm_ versions (90: H100/H200)")
    ap.add_argument("--bam-source", help="a kernels/bam_attention_triton.py to count instead (e.g. an old copy)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compiles")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument(
        "--only", nargs="+", metavar="KERNEL:VARIANT", help="of the BAM kernels × variants asked, only these pairs"
    )
    a = ap.parse_args(argv)
    names = {name: key for key, name in KERNELS.items() if name}

    bam = load_module("megabam.kernels.bam_attention_triton", a.bam_source)
    mlstm = load_module("megabam.kernels.mlstm_triton", None) if "mlstm" in a.kernels else None
    bam_wanted = {KERNELS[k] for k in a.kernels if k.startswith("bam")}
    for dtype in a.dtypes:
        launches = []
        if bam_wanted:
            for variant in a.variants:
                launches += [
                    (bam, x)
                    for x in bam_launches(bam, DTYPES[dtype], variant)
                    if x.kernel in bam_wanted and (not a.only or f"{names[x.kernel]}:{variant}" in a.only)
                ]
        if mlstm:
            launches += [(mlstm, x) for x in mlstm_launches(mlstm, DTYPES[dtype])]
        for module, launch in launches:
            for config in configs_of(getattr(module, launch.kernel), launch):
                for arch in a.arch:
                    JOBS[len(JOBS)] = (module, launch, config, arch, dtype)
    with ProcessPoolExecutor(max(1, a.jobs), mp_context=multiprocessing.get_context("fork")) as pool:
        rows = list(pool.map(run_job, sorted(JOBS)))
    print(table(rows))
    if any(r["arch"] == "sm_100" and "error" not in r for r in rows):
        print(SM100_NOTE)
    for arch in a.arch:
        of_arch = [r for r in rows if r["arch"] == f"sm_{arch}"]
        failed = [r for r in of_arch if "error" in r]
        if failed:
            print(f"sm_{arch}: {len(failed)} of {len(of_arch)} not compiled, e.g. {failed[0]['error']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
