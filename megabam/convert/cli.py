"""`megabam convert inspect|consolidate|average|reshard|to-hf|from-hf`: read a checkpoint of any layout,
write it as full tensors (or the mean of several), at another layout, or as a folder that transformers
loads, and bring such a folder back.

Bad input (a path, a checkpoint that does not verify or does not fit its config, an output that
exists) is one line on stderr and exit 2, before anything is written; the input is never modified.
"""

import json
from pathlib import Path

from megabam import exit_codes


def add_convert_parser(sub) -> None:
    cv = sub.add_parser("convert", help="inspect, consolidate or export a checkpoint; import a Hugging Face model")
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
    _writer_arguments(co)
    av = tasks.add_parser(
        "average",
        help="the mean of the weights of checkpoints of one model, as a consolidated folder",
        description="Write OUT as consolidate does, holding the mean of the sources' weights (a run's last "
        "checkpoints: Polyak averaging) with the config and metadata of the newest. The sources may differ "
        "in layout, not in model.",
    )
    _writer_arguments(av, several=True)
    hf = tasks.add_parser(
        "to-hf",
        help="a folder transformers loads (AutoModelForCausalLM, trust_remote_code) with only torch installed",
        description="Write OUT: config.json with auto_map, safetensors weights, the modeling code with the megabam "
        "model sources it needs, the tokenizer (sentencepiece model, tokenizer.json and configs).",
    )
    _writer_arguments(hf)
    rs = tasks.add_parser(
        "reshard",
        help="a checkpoint re-split for another tensor × pipeline × data layout, optimizer state and all",
        description="Write OUT: a run directory (config.yaml at the new layout, tokenizer, metrics, one checkpoint) "
        "that `megabam train OUT/config.yaml` resumes on TP·PP·DP ranks: weights, fp32 master weights, Adam "
        "moments and step, schedule, data position, window sampler and RNG. A --dp change keeps the global batch "
        "(train.grad_accum scaled), so the data order is kept. Runs TP·PP·DP local CPU processes.",
    )
    rs.add_argument("source", help="checkpoint directory, or run directory (its newest verified checkpoint)")
    rs.add_argument("out", help="output run directory (must not exist, unless --overwrite)")
    rs.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    rs.add_argument("--pp", type=int, required=True, help="pipeline-parallel size")
    rs.add_argument("--dp", type=int, help="data-parallel size (default: the checkpoint's)")
    rs.add_argument(
        "--zero-stage", type=int, choices=[1, 2], help="ZeRO stage of the new layout (default: the checkpoint's)"
    )
    rs.add_argument("--overwrite", action="store_true", help="replace OUT once the new run directory is complete")
    fh = tasks.add_parser(
        "from-hf",
        help="a megabam export or a transformers Llama as a consolidated folder (train.init_from=OUT continues "
        "pretraining)",
    )
    fh.add_argument("source", help="the Hugging Face folder (megabam convert to-hf's, or a LlamaForCausalLM's)")
    fh.add_argument("out", help="output folder (must not exist, unless --overwrite)")
    fh.add_argument("--overwrite", action="store_true", help="replace OUT once the new folder is complete")


def _writer_arguments(p, several: bool = False) -> None:
    """What consolidate, average and to-hf take: the checkpoint(s), the output and how the weights are written."""
    checkpoint = "checkpoint directory, or run directory (its newest verified checkpoint)"
    if several:
        p.add_argument("sources", nargs="+", metavar="source", help=f"two or more: {checkpoint}")
    else:
        p.add_argument("source", help=checkpoint)
    p.add_argument("out", help="output folder (must not exist, unless --overwrite)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the weights written")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT once the new folder is complete")


def run_convert(args) -> int:

    lines = {
        "inspect": _inspect,
        "consolidate": _consolidate,
        "average": _average,
        "reshard": _reshard,
        "to-hf": _to_hf,
        "from-hf": _from_hf,
    }[args.task](args)
    print("\n".join(lines))
    return exit_codes.OK


def _inspect(args) -> list[str]:
    from megabam.convert.inspect_checkpoint import inspect, report_lines

    report = inspect(Path(args.source))
    return [json.dumps(report, indent=1)] if args.json else report_lines(report)


def _max_bytes(args) -> int:
    from megabam.checkpoint.safetensors_io import parse_size
    from megabam.staging import OutputError

    try:
        return parse_size(args.max_shard_size)
    except ValueError as e:
        raise OutputError(None, "--max-shard-size", str(e)) from None


def _consolidate(args) -> list[str]:
    from megabam.checkpoint.consolidated import consolidate

    return consolidate(Path(args.source), Path(args.out), args.dtype, _max_bytes(args), args.overwrite)


def _average(args) -> list[str]:
    from megabam.checkpoint.consolidated import average
    from megabam.errors import BadArgument

    if len(args.sources) < 2:
        raise BadArgument(None, "source", f"average needs two or more checkpoints, got {len(args.sources)}")
    return average([Path(s) for s in args.sources], Path(args.out), args.dtype, _max_bytes(args), args.overwrite)


def _reshard(args) -> list[str]:
    from megabam.convert.reshard import reshard

    return reshard(Path(args.source), Path(args.out), args.tp, args.pp, args.dp, args.zero_stage, args.overwrite)


def _to_hf(args) -> list[str]:
    from megabam.convert.hf_export import to_hf

    return to_hf(Path(args.source), Path(args.out), args.dtype, _max_bytes(args), args.overwrite)


def _from_hf(args) -> list[str]:
    from megabam.convert.hf_import import from_hf

    return from_hf(Path(args.source), Path(args.out), args.overwrite)
