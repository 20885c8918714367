"""`megabam train CONFIG [key.sub=value ...]`: pretrain a model; `--print-config` shows the resolved
config, `--dry-run` what the run would be, `--help-config` every key.

Nothing heavy is imported before the config is known to be good: torch, DeepSpeed and the trainer
cost seconds."""

import dataclasses
import os
import signal
import sys
import typing
from pathlib import Path

import yaml

from megabam import exit_codes, process
from megabam.config import Config, load_config
from megabam.config.loader import DEFAULTS_KEY, config_differences, config_to_dict
from megabam.errors import BadArgument
from megabam.train.preemption import Preempted, exit_words, handle_start_up_signals


def add_train_parser(sub) -> None:
    train = sub.add_parser(
        "train",
        help="pretrain a model from a YAML config",
        description=(
            "Pretrain a model. Example: megabam train yaml_configs/tiny_cpu.yaml optim.lr=1e-3 --fresh "
            "(options and overrides in any order). A config may start from others: "
            f"'{DEFAULTS_KEY}: [base.yaml, ...]' (relative to it; later files and the overrides win)."
        ),
    )
    train.add_argument("config", nargs="?", help="YAML config file (see yaml_configs/)")
    train.add_argument(
        "overrides",
        nargs="*",
        metavar="key.sub=value",
        help="dotted overrides of config values; a list in YAML's flow form, e.g. window.windows=[64,256] "
        "(--help-config shows each list's form)",
    )
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
    train.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as YAML (what the overrides changed first, as comments), then exit",
    )
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve and check the config, build the model on the meta device and print its parameters, the "
        "planner's memory per device for this layout and the data it would read; nothing is trained or written",
    )


def run_train(args) -> int:
    handle_start_up_signals()
    if args.help_config:
        print("\n".join(describe_config(Config)))
        return exit_codes.OK
    if args.config is None:
        raise BadArgument(
            None, "CONFIG", "train needs a config file (e.g. yaml_configs/tiny_cpu.yaml; --help-config lists every key)"
        )
    if args.fresh and args.resume:
        raise BadArgument(None, "--fresh", "starts a new run, --resume continues one; give one of them")
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(resolved_yaml(cfg, load_config(args.config), args.overrides), end="")
        return exit_codes.OK
    if args.dry_run:
        print("\n".join(dry_run(cfg, args.config)))
        return exit_codes.OK
    # Who this rank is, before anything reads RANK (rank 0 alone takes the run directory's lock):
    # mpirun and srun name ranks in their own variables.
    from megabam.parallel.ranks import launch_environment, launcher_of

    launched = launcher_of(os.environ) != "none"
    os.environ.update(launch_environment())
    if launched:
        _die_with_the_launcher()
    process.cpu_accelerator_without_cuda()
    from megabam.train.trainer import AlreadyComplete, TooManyBadSteps, train

    process.start_collecting()
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


def _die_with_the_launcher() -> None:
    """Under a launcher (torchrun, the deepspeed launcher, mpirun, srun), stop at once when it dies: its
    ranks run in sessions of their own, so a scheduler's kill of the launcher's process group would
    otherwise leave them training on."""
    process.parent_death_signal(signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the request took effect
        os._exit(exit_codes.PREEMPTED)


def describe_config(cls, prefix: str = "") -> list[str]:
    """One line per key: its dotted name, default and meaning; a list's command-line form after it."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines += describe_config(tp, prefix + f.name + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        text = f.metadata.get("doc", "")
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if item is not None and dataclasses.is_dataclass(item):  # a list of sections: each key of an entry
            example = ", ".join(f"{g.name}: ..." for g in dataclasses.fields(item)[:2])
            text += f" On the command line: {prefix + f.name}='[{{{example}}}, ...]'."
            lines.append(f"{prefix + f.name:40s} {default!r:>14}  {text}")
            lines += describe_config(item, prefix + f.name + "[].")
            continue
        if item is not None:
            text += f" On the command line: {prefix + f.name}=[a,b,...] (YAML flow list)."
        lines.append(f"{prefix + f.name:40s} {default!r:>14}  {text}")
    return lines


def resolved_yaml(cfg: Config, from_files: Config, overrides: list[str]) -> str:
    """The resolved config as YAML (loadable by `megabam train`), headed by comment lines naming each
    value the command-line overrides changed from the files' value."""
    changed = [
        f"# {key}: {before!r} → {after!r} (command line)"
        for key, before, after in config_differences(config_to_dict(from_files), config_to_dict(cfg))
    ]
    head = changed or ["# no value changed by the command line"]
    return "\n".join(head) + "\n" + yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def dry_run(cfg: Config, path: str) -> list[str]:
    """What `megabam train` would do with `cfg`, without doing it: the model built on the meta device,
    the layout and the planner's memory for it, the data, the run directory."""
    from megabam.plan.counts import meta_model, params_by_component
    from megabam.plan.planner import GIB, config_layout

    model = meta_model(cfg)
    params = params_by_component(model)
    total = sum(params.values())
    world = _world_size(cfg)
    layout = config_layout(cfg, world)
    device = "cuda" if _has_cuda() else "cpu"
    from megabam.plan.memory import memory_bytes

    memory = memory_bytes(cfg, model, layout, device)
    tokens = cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.data.seq_len * layout.data
    lines = [
        f"megabam train {path}: dry run (the config resolves and checks; nothing trained, nothing written)",
        f"model: {total:,} parameters ({_layers(model.layer_types)}, d_model {cfg.model.d_model}, "
        f"{cfg.model.n_heads} heads, vocabulary {cfg.model.vocab_size:,})",
        *(f"  {name}: {n:,}" for name, n in sorted(params.items(), key=lambda kv: -kv[1])),
        f"layout: {world} rank(s) = {layout.describe()}; {tokens:,} tokens per step × {cfg.train.steps:,} steps",
        f"memory per {device} device (planner): {memory['total'] / GIB:.2f} GiB = "
        + ", ".join(f"{k} {v / GIB:.2f}" for k, v in memory.items() if k != "total"),
        f"data: {_data_line(cfg)}",
        f"run directory: {_run_dir_line(Path(cfg.run.output_dir) / cfg.run.name)}",
    ]
    return lines


def _layers(kinds: list[str]) -> str:
    counts = {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}
    return f"{len(kinds)} layers: " + ", ".join(f"{kind} ×{n}" for kind, n in counts.items())


def _run_dir_line(run_dir: Path) -> str:
    from megabam.checkpoint.store import list_tags

    tags = list_tags(run_dir) if run_dir.is_dir() else []
    if tags:
        return f"{run_dir} (holds checkpoints up to {tags[0]}: training resumes from the newest that verifies)"
    if run_dir.is_dir() and any(run_dir.iterdir()):
        return f"{run_dir} (exists without checkpoints)"
    return f"{run_dir} (new)"


def _world_size(cfg: Config) -> int:
    """The launcher's world size when launched, else the config's layout (data 0 = one replica)."""
    p = cfg.parallel
    if "WORLD_SIZE" in os.environ and os.environ["WORLD_SIZE"].isdigit():
        return int(os.environ["WORLD_SIZE"])
    return p.tensor * p.pipeline * max(p.data, 1)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _data_line(cfg: Config) -> str:
    d = cfg.data
    if d.source == "default":
        from megabam.data.training_data import data_cache

        return (
            f"the embedded default corpus ({d.corpus_bytes:,} bytes of Python's standard library source, "
            f"{d.passkey_fraction:.0%} passkey documents) at {d.seq_len} tokens, built in {data_cache(d.cache_dir)}"
        )
    streams = "; ".join(
        s.path + (f" ← {s.remote}" if s.remote else "") + (f" (weight {s.weight})" if s.weight else "")
        for s in d.streams
    )
    return f"{len(d.streams)} prepared stream(s) at {d.seq_len} tokens, tokenizer {d.tokenizer}: {streams}"
