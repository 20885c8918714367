"""`megabam plan CONFIG [overrides] --gpu NAME --nodes N --gpus-per-node G [--json] [--calibration PATH]`.

The planner itself (torch, the model) is imported only when the command runs: `megabam` must start in
a fraction of a second (its signal handlers go in before torch is imported)."""

import dataclasses
import json

from megabam import exit_codes
from megabam.config import load_config
from megabam.errors import BadArgument
from megabam.plan.calibration import TABLE, load_table
from megabam.plan.hardware import GPUS


def add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="whether a config fits given GPUs, at which layout, and how fast (before the booking)",
        description="Parameters, FLOPs, memory per GPU, communication and a roofline step time of a config "
        "on the GPUs given; the verdict on its own layout and the best layouts ranked by throughput.",
    )
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides of config values")
    p.add_argument("--gpu", choices=sorted(GPUS), required=True)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--top", type=int, default=5, help="best layouts to list (default 5)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    p.add_argument(
        "--calibration",
        default=str(TABLE),
        metavar="PATH",
        help="the table of measured per-op efficiencies for the calibrated estimate beside the roofline "
        "(default: the one megabam ships, megabam/plan/calibration.json)",
    )


MAX_NODES = 100_000  # beyond any cluster built; keeps the layout search to seconds


def run_plan(args) -> int:
    for flag, value, most in (("--nodes", args.nodes, MAX_NODES), ("--gpus-per-node", args.gpus_per_node, 64)):
        if not 1 <= value <= most:  # the search grows with the world's divisors: 10⁹ nodes ran for minutes
            raise BadArgument(None, flag, f"must lie in 1..{most:,}, got {value:,}")
    cfg = load_config(args.config, args.overrides)
    table = load_table(args.calibration, GPUS)
    from megabam.plan.planner import plan

    result = plan(cfg, GPUS[args.gpu], args.nodes, args.gpus_per_node, args.top, table.get(args.gpu))
    note = calibration_note(table, result, args)
    print(json.dumps(as_json(result, note), indent=1) if args.json else "\n".join(report(result, note)))
    return exit_codes.OK


def calibration_note(table: dict, p, args) -> str:
    """Where the calibrated figures come from, or why there are none."""
    calibration = table.get(args.gpu)
    if calibration is None:
        held = ", ".join(sorted(table)) or "none: no GPU has run tools/bench_gpu_train.py --write-calibration yet"
        return f"no calibration for {args.gpu} in {args.calibration} (it holds {held})"
    missing = calibration.missing(p.own.work) if p.own is not None else []
    if missing:
        return f"{calibration.describe()}: no efficiency measured for {', '.join(missing)}, which this config runs"
    return calibration.describe()


def _estimate_json(e) -> dict:
    return {
        "layout": dataclasses.asdict(e.layout),
        "memory_bytes": e.memory,
        "capacity_bytes": e.capacity,
        "fits": e.fits,
        "margin_bytes": e.margin,
        "communication_bytes_per_step": e.communication,
        "seconds_per_step": e.times,
        "tokens_per_s": e.tokens_per_s,
        "mfu": e.mfu,
        "training_flops_per_token": e.flops_per_token,
        "roofline_seconds_by_kind": e.work,
        "calibrated_tokens_per_s": e.calibrated_tokens_per_s,
        "calibrated_mfu": e.calibrated_mfu,
    }


def as_json(p, calibration: str) -> dict:
    return {
        "calibration": calibration,
        "gpu": dataclasses.asdict(p.gpu),
        "nodes": p.nodes,
        "gpus_per_node": p.gpus_per_node,
        "parameters": p.params,
        "forward_flops_per_token": p.forward_flops,
        "model_flops_per_token": p.model_flops,
        "config_layout": None if p.own is None else _estimate_json(p.own),
        "config_layout_problem": p.own_problem,
        "best_layouts": [_estimate_json(e) for e in p.best],
    }


def report(p, calibration: str) -> list[str]:
    from megabam.plan.planner import GIB

    total = sum(p.params.values())
    lines = [
        f"parameters: {total:,} ({total / 1e9:.3f} B)",
        "",
        "| component | parameters | share |",
        "|---|---:|---:|",
    ]
    lines += [f"| {k} | {v:,} | {v / total:.1%} |" for k, v in sorted(p.params.items(), key=lambda kv: -kv[1])]
    fwd = sum(p.forward_flops.values())
    lines += ["", f"FLOPs per token: forward {fwd:.4g}, training (3×) {p.model_flops:.4g}", ""]
    lines += ["| component | forward FLOPs/token | share |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.4g} | {v / fwd:.1%} |" for k, v in sorted(p.forward_flops.items(), key=lambda kv: -kv[1])]
    world = p.nodes * p.gpus_per_node
    lines += ["", f"{world} × {p.gpu.name} ({p.nodes} node(s) × {p.gpus_per_node})"]
    if p.own is None:
        lines += [f"config layout: {p.own_problem}"]
    else:
        e = p.own
        verdict = "fits" if e.fits else "does NOT fit"
        lines += [
            f"config layout {e.layout.describe()}: {verdict}: {e.memory['total'] / GIB:.1f} of "
            f"{e.capacity / GIB:.1f} GiB per GPU (margin {e.margin / GIB:+.1f} GiB)",
            "",
            "| memory per GPU | GiB |",
            "|---|---:|",
        ]
        lines += [f"| {k} | {v / GIB:.2f} |" for k, v in e.memory.items()]
        lines += ["", f"training FLOPs per token with recompute={e.layout.recompute}: {e.flops_per_token:.4g}"]
        lines += ["", "| per step | bytes per rank | seconds |", "|---|---:|---:|"]
        for k, v in e.times.items():
            lines.append(
                f"| {k} | {e.communication.get(k, 0) / GIB:.2f} GiB | {v:.3f} |"
                if k in e.communication
                else f"| {k} | | {v:.3f} |"
            )
        lines.append(
            f"predicted: {e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%} (a roofline: an upper bound; tuned 7B "
            "dense runs publish 47-52 % MFU)"
        )
        if e.calibrated_tokens_per_s is not None:
            lines.append(
                f"calibrated: {e.calibrated_tokens_per_s:,.0f} tokens/s, MFU {e.calibrated_mfu:.1%} "
                f"(each kind of work at the efficiency measured on {calibration})"
            )
    lines += ["", f"calibration: {calibration}"]
    lines += ["", "best layouts that fit, by predicted throughput:", ""]
    lines += [
        "| layout | GiB per GPU | tokens/s (roofline) | MFU (roofline) | tokens/s (calibrated) | MFU (calibrated) "
        "| step s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {e.layout.describe()} | {e.memory['total'] / GIB:.1f} | {e.tokens_per_s:,.0f} | {e.mfu:.1%} | "
        f"{_calibrated(e)} | {e.times['step']:.2f} |"
        for e in p.best
    ] or ["| none fits | | | | | | |"]
    return lines


def _calibrated(e) -> str:
    """The calibrated tokens/s and MFU cells: blank where the table has no calibration for them."""
    if e.calibrated_tokens_per_s is None:
        return "- | -"
    return f"{e.calibrated_tokens_per_s:,.0f} | {e.calibrated_mfu:.1%}"
