"""End-to-end training speed on one GPU at realistic widths, beside what the planner predicts, and the
per-op efficiencies the planner's calibrated estimate reads (megabam/plan/calibration.py).

Models, each at its config's own length, micro-batch 1, bf16, recompute as its config says, on one GPU
(ZeRO-1 over one rank): BAM 1.1B (GGD prior + SSMax, 2,048 tokens) and the same with RoPE instead of
the prior (SSMax kept), SWAX 1.4B at 16,384 tokens with its mLSTM layers and with Gated DeltaNet in
their place. Random tokens, one document per sequence (full causal attention, what the planner counts).

Method (as tools/bench_cpu_train.py: each model in a fresh process, warm-up steps untimed): the
trainer's own step (megabam/train/engine.py: the DeepSpeed engine's forward, backward and optimizer
step) at each SWA window the window sampler draws: `--warmup` untimed steps, `--steps` timed steps,
one step under torch.profiler. A model's step time is the windows' times weighted by how often the
sampler draws each (as the planner weights their FLOPs). Per model:
- tokens/s; MFU from the planner's FLOPs per token (megabam/plan/counts.py, causal, as the trainer logs
  it) beside MFU counted as Megatron-LM, PaLM and LLM Foundry publish theirs (every query against every
  key: causal=False), both at the dense bf16 peak of megabam/plan/hardware.py; the planner's roofline
  tokens/s for the same one-GPU layout;
- the peak memory of the timed steps (torch.cuda.max_memory_allocated; on CPU the trainer's count of
  live tensors over one more step, at the first window) beside the planner's prediction
  (megabam/plan/memory.py);
- the profiled step's GPU time by kind of op: attention, the mLSTM or Gated DeltaNet cell, matmul,
  norm/elementwise, optimizer, other (copies, communication); of the timed step, what no kernel covers
  is the GPU idle.
`--write-calibration PATH` puts the efficiencies (the planner's roofline seconds per kind over the
profiled ones, over all models) into the table at PATH under the GPU's name.

On one H100 or H200 (tools/gpu_check.sh runs it, ~3 minutes):
    python tools/bench_gpu_train.py --out runs/bench_gpu_train.json --write-calibration megabam/plan/calibration.json
`--dry-run` runs the same path on CPU at tiny sizes against the H100's figures (it proves the script,
not the GPU; one process for all models): python tools/bench_gpu_train.py --dry-run
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from megabam.plan.calibration import KINDS, Calibration, measured_entry, write_entry  # no torch: the parent's
from megabam.plan.hardware import GPUS

REPO = Path(__file__).resolve().parents[1]
# name: (config, overrides)
MODELS = {
    "bam_1p1b": ("yaml_configs/bam_1p1b.yaml", []),
    "bam_1p1b_rope": ("yaml_configs/bam_1p1b.yaml", ["model.attention.positional=rope"]),
    "swax_1p4b_mlstm": ("yaml_configs/swax_1p4b_16k.yaml", []),
    "swax_1p4b_gdn": ("yaml_configs/swax_1p4b_16k.yaml", ["model.layer_pattern=[SG]"]),
}
ONE_GPU = ["parallel.data=1", "train.micro_batch_size=1", "train.grad_accum=1", "train.precision=bf16"]
DRY = [  # tiny sizes on CPU: seconds in all
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.ffn_hidden=128",
    "model.vocab_size=256",
    "model.attention.kv_heads=2",
    "model.mlstm.n_heads=2",
    "data.seq_len=128",
    "window.windows=[16,64]",
]
SPLIT = (*KINDS, "other")  # what a profiled step's time splits into
COLUMNS = {"attention": "attention", "cell": "mLSTM/GDN cell", "matmul": "matmul"}
COLUMNS |= {"elementwise": "norm/elementwise", "optimizer": "optimizer", "other": "other"}

# A profiled kernel (on CPU: an op) counts as the first kind whose pattern its names match: its own,
# the op that launched it and that op's enclosing ranges, and in the backward pass the same of the
# forward op autograd links its node to (so a backward kernel counts where its forward ran). The
# dispatch point runs attention and the mLSTM cell inside ranges named for them (kernels/dispatch.py),
# the Gated DeltaNet its cell (megabam/model/gated_deltanet.py), this script the optimizer's step.
RULES = [
    ("optimizer", re.compile(r"megabam\.optimizer_step|Optimizer\.step")),
    ("attention", re.compile(r"attention|flash|fmha|triton_tem|flex", re.I)),
    ("mlstm", re.compile(r"mlstm", re.I)),
    ("gated_deltanet", re.compile(r"deltanet", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|aten::(mm|addmm|bmm|baddbmm|matmul|linear)\b", re.I)),
]
OTHER_KERNEL = re.compile(r"memcpy|memset|nccl", re.I)  # every other kernel is a norm or elementwise pass
BACKWARD = "autograd::engine::evaluate_function: "


def kind_of(context: str, kernel: bool) -> str:
    for kind, pattern in RULES:
        if pattern.search(context):
            return kind
    if kernel:
        return "other" if OTHER_KERNEL.search(context) else "elementwise"
    return "elementwise" if context.startswith("aten::") else "other"  # on CPU, the framework's own time


def op_split(events, on_gpu: bool) -> dict[str, float]:
    """Seconds by SPLIT of one profiled step: on the GPU its kernels' time, on the CPU each op's own."""
    from torch.autograd import DeviceType

    chains, nodes = {}, {}

    def chain(e) -> str:  # the names of e and its enclosing ranges, innermost first
        if id(e) not in chains:
            chains[id(e)] = e.name + (" < " + chain(e.cpu_parent) if e.cpu_parent is not None else "")
        return chains[id(e)]

    def node(e) -> int | None:  # the sequence number of the backward node e runs in, if any
        if id(e) not in nodes:
            up = e.cpu_parent
            nodes[id(e)] = e.sequence_nr if e.name.startswith(BACKWARD) else (node(up) if up is not None else None)
        return nodes[id(e)]

    ops = [e for e in events if e.device_type == DeviceType.CPU]
    # The forward op of each sequence number: ops that create no autograd node (no input needs a
    # gradient) take the number of the next one that does, so the last op to take it, the outermost
    # where ops nest (aten::linear around aten::addmm), is the one whose node it is.
    forward = {}
    for e in ops:  # in start order
        up = e.cpu_parent
        if e.sequence_nr >= 0 and node(e) is None and (up is None or up.sequence_nr != e.sequence_nr):
            forward[e.sequence_nr] = e

    def context(e) -> str:
        linked = forward.get(node(e))
        return chain(e) + (" < forward: " + chain(linked) if linked is not None else "")

    seconds = dict.fromkeys(SPLIT, 0.0)
    if not on_gpu:
        for e in ops:
            seconds[kind_of(context(e), kernel=False)] += e.self_cpu_time_total / 1e6
        return seconds
    attached = Counter()
    for e in ops:
        for k in e.kernels:
            seconds[kind_of(f"{k.name} < {context(e)}", kernel=True)] += k.duration / 1e6
            attached[k.name, k.duration] += 1
    # A kernel launched outside any op or range is attached to none: its own name decides. The kernels
    # attached above are in the event list too, with the same name and duration: not counted twice.
    for d in events:
        if d.device_type == DeviceType.CUDA:
            key = (d.name, d.time_range.elapsed_us())
            if attached[key]:
                attached[key] -= 1
            else:
                seconds[kind_of(d.name, kernel=True)] += key[1] / 1e6
    return seconds


def measure(name: str, args, gpu) -> dict:
    """Child: one model's figures (the module docstring's method)."""
    import torch

    from megabam.config import load_config
    from megabam.kernels.dispatch import logged_choices
    from megabam.parallel.topology import build_topology
    from megabam.plan.counts import meta_model, training_flops_per_token, window_draws
    from megabam.plan.memory import memory_bytes
    from megabam.plan.planner import config_layout, estimate
    from megabam.train.engine import build_engine, tracked_step

    path, overrides = MODELS[name]
    overrides = [*ONE_GPU, *overrides, *(DRY if args.dry_run else [])]
    cfg = load_config(REPO / path, overrides)
    logged_choices.clear()  # each model's own choices, where models share a process (a dry run)
    engine = build_engine(cfg, build_topology(1, 1, 0))
    step_optimizer = engine.deepspeed.step

    def labelled_step():  # the optimizer's step in a profiler range (RULES), as TrainingEngine.step calls it
        with torch.profiler.record_function("megabam.optimizer_step"):
            step_optimizer()

    engine.deepspeed.step = labelled_step
    device = engine.device
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.data.seq_len + 1), device=device)
    batch = [{"input_ids": ids[:, :-1], "labels": ids[:, 1:], "doc_ids": None}]  # one document per sequence

    shares: dict = {}
    for window, share in window_draws(cfg):  # the anneal's window is one of the draws' too: merged
        shares[window] = shares.get(window, 0.0) + share
    step_s, peak, profile, windows = 0.0, 0, dict.fromkeys(SPLIT, 0.0), []
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    for window, share in shares.items():
        for _ in range(args.warmup):
            engine.step(batch, window)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        elif not peak:  # no allocator statistics on CPU: the trainer's count of live tensors, over one step
            peak = tracked_step(engine, batch, window)[1]
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = engine.step(batch, window)
        sync()
        seconds = (time.perf_counter() - t0) / args.steps
        if on_gpu:
            peak = max(peak, torch.cuda.max_memory_allocated(device))
        with torch.profiler.profile(activities=activities) as prof:
            engine.step(batch, window)
            sync()
        for kind, value in op_split(prof.events(), on_gpu).items():
            profile[kind] += share * value
        step_s += share * seconds
        windows.append({"window": window, "share": share, "step_s": seconds})

    meta = meta_model(cfg)
    layout = config_layout(cfg, 1)
    roofline = estimate(cfg, meta, layout, gpu, 1)
    flops = training_flops_per_token(cfg, meta)["model"]
    flops_noncausal = training_flops_per_token(cfg, meta, causal=False)["model"]
    tokens_per_s = tokens / step_s
    return {
        "model": name,
        "config": path,
        "overrides": overrides,
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu (dry run)",
        "gpu": gpu.name,
        "parameters": engine.params,
        "tokens_per_step": tokens,
        "windows": windows,
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "model_flops_per_token": flops,
        "noncausal_flops_per_token": flops_noncausal,
        "mfu": flops * tokens_per_s / (gpu.peak_tflops * 1e12),
        "mfu_noncausal": flops_noncausal * tokens_per_s / (gpu.peak_tflops * 1e12),
        "roofline_tokens_per_s": roofline.tokens_per_s,
        "roofline": roofline.work,
        "profile": profile,
        "peak_memory_bytes": peak,
        "predicted_memory_bytes": memory_bytes(cfg, meta, layout, device.type)["total"],
        "loss": float(loss),
        "ops": sorted(f"{op}:{choice}" for op, _, choice, _ in logged_choices),
    }


def run_child(args) -> None:
    """Child: the models named, each one JSON line (its figures or its error) appended to --child-out."""
    from megabam import process
    from megabam.log import setup_logging

    process.begin()
    process.cpu_accelerator_without_cuda()
    import torch

    from megabam.parallel.distributed import init_distributed
    from megabam.plan.hardware import gpu_of_device

    setup_logging(0)  # the dispatch point's choices, as training logs them
    init_distributed()
    gpu = GPUS[args.gpu] if args.gpu else gpu_of_device(torch.cuda.get_device_name())
    if gpu is None:
        raise SystemExit(
            f"{torch.cuda.get_device_name()}: not a GPU megabam/plan/hardware.py knows; name one with --gpu"
        )
    process.start_collecting()
    for name in args.child:
        try:
            row = measure(name, args, gpu)
        except torch.cuda.OutOfMemoryError as e:
            row = {"model": name, "error": f"out of memory: {str(e).splitlines()[0]}"}
        with open(args.child_out, "a") as f:
            f.write(json.dumps(row) + "\n")


def run_all(args) -> list[dict]:
    """Parent (no torch): each model in a fresh process (one process for all in a dry run, where
    nothing can run out of memory), within the time budget."""
    names = args.models or list(MODELS)
    groups = [names] if args.dry_run else [[n] for n in names]
    deadline = time.monotonic() + args.budget_s
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, group in enumerate(groups):
            out = Path(tmp, f"{i}.jsonl")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", *group, "--child-out", str(out)]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            cmd += (["--dry-run"] if args.dry_run else []) + (["--gpu", args.gpu] if args.gpu else [])
            limit = min(deadline - time.monotonic(), args.model_limit_s * len(group))
            try:
                code = subprocess.run(cmd, timeout=max(1.0, limit)).returncode
                error = f"failed (exit {code})" if code else "no result"
            except subprocess.TimeoutExpired:
                error = f"stopped at its time limit ({limit:.0f} s)"
            finished = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
            rows += [next((r for r in finished if r["model"] == n), {"model": n, "error": error}) for n in group]
    return rows


def split_cells(r: dict) -> list[float]:
    """A row's profiled seconds by COLUMNS (the two cells in one) and the GPU's idle rest, as shares of
    its step."""
    p, step = r["profile"], r["step_s"]
    seconds = [p["attention"], p["mlstm"] + p["gated_deltanet"], *(p[k] for k in list(COLUMNS)[2:])]
    return [s / step for s in seconds] + [max(0.0, 1 - sum(p.values()) / step)]


def table(rows: list[dict]) -> list[str]:
    gib = 2**30
    lines = [
        "| model | parameters | tokens/step | tokens/s | MFU (causal) | MFU (non-causal) | roofline tokens/s "
        "| measured / roofline | peak GiB | predicted GiB | predicted / peak | ops |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['error']} |" + " |" * 10)
            continue
        peak, predicted = r["peak_memory_bytes"], r["predicted_memory_bytes"]
        lines.append(
            f"| {r['model']} | {r['parameters']:,} | {r['tokens_per_step']:,} | {r['tokens_per_s']:,.0f} | "
            f"{r['mfu']:.1%} | {r['mfu_noncausal']:.1%} | {r['roofline_tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / r['roofline_tokens_per_s']:.2f} | {peak / gib:.2f} | {predicted / gib:.2f} | "
            f"{predicted / peak:.2f} | {', '.join(r['ops'])} |"
        )
    lines += ["", "The step by op (the profiled step's time, as shares of the timed step):", ""]
    lines.append("| model | step ms | " + " | ".join(COLUMNS.values()) + " | GPU idle |")
    lines.append("|---|---:|" + "---:|" * (len(COLUMNS) + 1))
    for r in rows:
        if "error" not in r:
            shares = " | ".join(f"{s:.0%}" for s in split_cells(r))
            lines.append(f"| {r['model']} | {r['step_s'] * 1e3:,.1f} | {shares} |")
    return lines


def calibration_lines(cal: Calibration, rows: list[dict]) -> list[str]:
    lines = ["", "Efficiency by kind (the planner's roofline seconds / profiled seconds, over the models):", ""]
    lines += ["| " + " | ".join(KINDS) + " | overhead |", "|" + "---:|" * (len(KINDS) + 1)]
    cells = [f"{cal.efficiency[k]:.3g}" if k in cal.efficiency else "-" for k in KINDS]
    lines += ["| " + " | ".join(cells) + f" | {cal.overhead:.1%} |", ""]
    lines += ["The calibration applied to the models it came from:", ""]
    lines += ["| model | measured step ms | calibrated ms | calibrated / measured |", "|---|---:|---:|---:|"]
    for r in rows:
        if cal.missing(r["roofline"]):  # a kind it ran took no profiled time: no efficiency
            continue
        step, calibrated = r["step_s"], cal.step_seconds(r["roofline"])
        lines.append(f"| {r['model']} | {step * 1e3:,.1f} | {calibrated * 1e3:,.1f} | {calibrated / step:.2f} |")
    return lines


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown (no git checkout where it ran)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), help="default: all")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per window")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per window first")
    ap.add_argument("--dry-run", action="store_true", help="the whole path on CPU at tiny sizes")
    ap.add_argument(
        "--gpu", choices=sorted(GPUS), help="whose peak and roofline (default: the device's; in a dry run h100-80gb)"
    )
    ap.add_argument("--budget-s", type=float, default=170.0, help="time for all models (default 170)")
    ap.add_argument("--model-limit-s", type=float, default=75.0, help="time for each model (default 75)")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    ap.add_argument("--write-calibration", type=Path, metavar="PATH", help="put the efficiencies into this table")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dry_run and not args.gpu:
        args.gpu = "h100-80gb"
    if args.child:
        run_child(args)
        return
    rows = run_all(args)
    print("\n".join(table(rows)))
    result = {"rows": rows}
    profiled = [r for r in rows if "error" not in r]
    if profiled and args.write_calibration:
        source = {
            "measured": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit(),
            "device": profiled[0]["device"],
            "command": " ".join(["python", "tools/bench_gpu_train.py", *sys.argv[1:]]),
        }
        result["calibration"] = entry = measured_entry(profiled, source)
        args.write_calibration.parent.mkdir(parents=True, exist_ok=True)
        write_entry(args.write_calibration, profiled[0]["gpu"], entry, GPUS)
        print("\n".join(calibration_lines(Calibration(profiled[0]["gpu"], **entry), profiled)))
        print(f"\nwrote the calibration of {profiled[0]['gpu']} into {args.write_calibration}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    sys.exit(1 if any("error" in r for r in rows) else 0)


if __name__ == "__main__":
    main()
