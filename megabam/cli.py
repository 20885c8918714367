"""The `megabam` command. Subcommands: train, launch, plan, data, eval, plot, repro, convert."""

import argparse
import dataclasses
import gc
import os
import signal
import sys
import typing

from megabam import exit_codes, remote_args
from megabam.config import Config, load_config
from megabam.convert.cli import add_convert_parser, run_convert
from megabam.data.cli import add_data_parser, run_data
from megabam.errors import BadArgument, UserError
from megabam.eval.cli import add_eval_parser, add_plot_parser, add_repro_parser, run_eval, run_plot, run_repro
from megabam.launch import add_launch_parser, parent_death_signal, run_launch
from megabam.plan.cli import add_plan_parser, run_plan
from megabam.train.preemption import Preempted, exit_words, handle_start_up_signals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megabam", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="pretrain a model from a YAML config",
        description="Pretrain a model. Example: megabam train yaml_configs/tiny_cpu.yaml optim.lr=1e-3",
    )
    train.add_argument("config", nargs="?", help="YAML config file (see yaml_configs/)")
    train.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides of config values")
    train.add_argument(
        "--resume",
        action="store_true",
        help="insist on continuing from a checkpoint (a run directory with checkpoints is resumed anyway)",
    )
    train.add_argument(
        "--fresh",
        action="store_true",
        help="start a new run even if run.output_dir/run.name holds one (in name-2, name-3, ...)",
    )
    train.add_argument(
        "--help-config", action="store_true", help="list every config key with its default and meaning, then exit"
    )
    add_launch_parser(sub)
    add_plan_parser(sub)
    add_data_parser(sub)
    add_eval_parser(sub)
    add_plot_parser(sub)
    add_repro_parser(sub)
    add_convert_parser(sub)

    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parser.parse_args(remote_args.decode(argv))  # `train`'s arguments across a remote shell
        return _run(args)
    except UserError as e:  # every command's bad input: one line, exit 2 (megabam/errors.py)
        print(f"megabam: error: {e}", file=sys.stderr)
        return exit_codes.BAD_INPUT


def _run(args) -> int:
    if args.command == "train":
        return _train(args)
    start_collecting()
    if args.command == "launch":
        return run_launch(args)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "data":
        return run_data(args)
    if args.command == "eval":
        return run_eval(args)
    if args.command == "plot":
        return run_plot(args)
    if args.command == "repro":
        return run_repro(args)
    if args.command == "convert":
        return run_convert(args)
    return exit_codes.BAD_INPUT


def _die_with_the_launcher() -> None:
    """Under a launcher (torchrun, the deepspeed launcher, mpirun, srun), stop at once when it dies: its
    ranks run in sessions of their own, so a scheduler's kill of the launcher's process group would
    otherwise leave them training on."""
    parent_death_signal(signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the request took effect
        os._exit(exit_codes.PREEMPTED)


def _train(args) -> int:
    handle_start_up_signals()
    if args.help_config:
        print("\n".join(describe_config(Config)))
        return exit_codes.OK
    if args.config is None:
        raise UserError(
            None, "CONFIG", "train needs a config file (e.g. yaml_configs/tiny_cpu.yaml; --help-config lists every key)"
        )
    if args.fresh and args.resume:
        raise BadArgument(None, "--fresh", "starts a new run, --resume continues one; give one of them")
    cfg = load_config(args.config, args.overrides)
    # Who this rank is, before anything reads RANK (rank 0 alone takes the run directory's lock):
    # mpirun and srun name ranks in their own variables.
    from megabam.parallel.ranks import launch_environment, launcher_of

    launched = launcher_of(os.environ) != "none"
    os.environ.update(launch_environment())
    if launched:
        _die_with_the_launcher()
    # Importing DeepSpeed and the trainer costs seconds; only after the config is known to be good.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megabam.train.trainer import AlreadyComplete, TooManyBadSteps, train

    start_collecting()
    try:
        summary = train(cfg, fresh=args.fresh, resume=args.resume)
    except TooManyBadSteps as e:
        print(f"megabam: error: {e}", file=sys.stderr)
        return exit_codes.BAD_STEPS
    except AlreadyComplete as e:  # nothing run, nothing written: the stored summary again
        summary = e.summary
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"megabam: {summary.run_dir} is already complete at step {summary.steps} (train.steps); nothing "
                "to do (raise train.steps to train on, or set run.name / --fresh for a new run)"
            )
            print("\n".join(["", "== megabam summary (stored) =="] + summary.lines()))
        return exit_codes.OK
    except Preempted as e:
        step, code = e.args
        what = "preempted" if code == exit_codes.PREEMPTED else "interrupted"
        print(f"megabam: {what} after step {step}; checkpoint saved, {exit_words(code)}", file=sys.stderr)
        return code
    if int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(["", "== megabam summary =="] + summary.lines()))
    return exit_codes.OK


def describe_config(cls, prefix: str = "") -> list[str]:
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            lines += describe_config(hints[f.name], prefix + f.name + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"{prefix + f.name:40s} {default!r:>14}  {f.metadata.get('doc', '')}")
    return lines


def start_collecting() -> None:
    """The end of a process's start-up (run() holds the garbage collector until here; so do
    tools/bench_cpu_train.py's cases): what the imports built lives as long as the process, so the
    collector is told to skip it from now on, then resumes. A no-op where collections were never held
    (main called in-process, by tests)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def run() -> None:
    """The process entry point (`megabam`, `python -m megabam.cli`): main's code, recorded for the
    launch scripts, as the exit status."""
    # Start-up imports (torch, DeepSpeed, the trainer) build millions of long-lived objects; each full
    # collection while they grow walks all of them, and the interpreter's last collection at exit walks
    # them again. No collections during start-up, and those objects frozen after it (start_collecting),
    # took a tiny training run from 5.0 to 4.1 s (docs/benchmarks.md, issue 16). Not frozen at exit too
    # (0.3 s more): objects of extensions (Triton's) left uncollected make them print leak warnings.
    gc.disable()
    # megabam compiles nothing, yet DeepSpeed's ZeRO optimizer check imports its Muon module, whose
    # module-level torch.compile loads the inductor backend: ~1 s of every process's start
    # (docs/benchmarks.md). With dynamo disabled torch.compile returns the function as it is. Set for
    # this process and those it starts; a value the user set wins.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    code = 1  # an exception escaping main: a traceback, exit 1
    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        raise
    finally:
        exit_codes.record(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
