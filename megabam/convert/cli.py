"""`megabam convert inspect|consolidate`: read a checkpoint of any layout, write it as full tensors.

Bad input (a path, a checkpoint that does not verify or does not fit its config, an output that
exists) is one line on stderr and exit 2, before anything is written; the input is never modified.
"""

import json
import sys
from pathlib import Path

from megabam import exit_codes


def add_convert_parser(sub) -> None:
    cv = sub.add_parser("convert", help="inspect or consolidate a checkpoint")
    tasks = cv.add_subparsers(dest="task", required=True)
    ins = tasks.add_parser("inspect", help="step, config, layout and every tensor of a checkpoint")
    ins.add_argument("source", help="checkpoint directory, or run directory (its newest verified checkpoint)")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    co = tasks.add_parser(
        "consolidate",
        help="a checkpoint of any tensor × pipeline (× data) layout as full tensors in safetensors",
        description="Write OUT: the one-process model's weights in safetensors (sharded with an index past "
        "--max-shard-size), config.yaml, tokenizer.model, megabam.json and consolidated.json. Weights only.",
    )
    co.add_argument("source", help="checkpoint directory, or run directory (its newest verified checkpoint)")
    co.add_argument("out", help="output folder (must not exist, unless --overwrite)")
    co.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the weights written")
    co.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    co.add_argument("--overwrite", action="store_true", help="replace OUT once the new folder is complete")


def run_convert(args) -> int:
    from megabam.convert.output import OutputError
    from megabam.train.checkpoint import CheckpointError

    try:
        lines = _inspect(args) if args.task == "inspect" else _consolidate(args)
    except (CheckpointError, OutputError) as e:
        print(f"megabam: error: {e}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    print("\n".join(lines))
    return exit_codes.OK


def _inspect(args) -> list[str]:
    from megabam.convert.inspect_checkpoint import inspect, report_lines

    report = inspect(Path(args.source))
    return [json.dumps(report, indent=1)] if args.json else report_lines(report)


def _consolidate(args) -> list[str]:
    from megabam.convert.consolidate import consolidate
    from megabam.convert.output import OutputError
    from megabam.convert.safetensors_out import parse_size

    try:
        max_bytes = parse_size(args.max_shard_size)
    except ValueError as e:
        raise OutputError(f"--max-shard-size: {e}") from None
    return consolidate(Path(args.source), Path(args.out), args.dtype, max_bytes, args.overwrite)
