"""The `megabam` command. Subcommands: train, launch, plan, data, eval, plot, repro, convert, config."""

import argparse
import sys

from megabam import exit_codes, process, progress, remote_args
from megabam.config.cli import add_config_parser, run_config
from megabam.convert.cli import add_convert_parser, run_convert
from megabam.data.cli import add_data_parser, run_data
from megabam.errors import UserError
from megabam.eval.cli import add_eval_parser, add_plot_parser, add_repro_parser, run_eval, run_plot, run_repro
from megabam.launch import add_launch_parser, run_launch
from megabam.plan.cli import add_plan_parser, run_plan
from megabam.train.cli import add_train_parser, run_train


class Parser(argparse.ArgumentParser):
    """argparse with options and positionals in any order (`megabam train CFG optim.lr=1e-3 --fresh` as
    well as `--fresh CFG optim.lr=1e-3`): each command's own parser reads its words with
    parse_intermixed_args, which argparse cannot do for a parser that holds subcommands, so those
    parse as usual and hand the rest to the chosen subcommand's parser (of this class too)."""

    def parse_known_args(self, args=None, namespace=None):
        if self._subparsers is not None or getattr(self, "_intermixing", False):
            return super().parse_known_args(args, namespace)
        self._intermixing = True  # parse_known_intermixed_args calls parse_known_args itself
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def build_parser() -> Parser:
    parser = Parser(prog="megabam", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_launch_parser(sub)
    add_plan_parser(sub)
    add_data_parser(sub)
    add_eval_parser(sub)
    add_plot_parser(sub)
    add_repro_parser(sub)
    add_convert_parser(sub)
    add_config_parser(sub)
    _add_quiet(parser)
    return parser


def _add_quiet(parser: argparse.ArgumentParser) -> None:
    """`--quiet` on every command that runs (each leaf of the command tree), for scripts: no progress
    bars or progress lines (megabam/progress.py), only results and errors."""
    subcommands = parser._subparsers._group_actions[0].choices if parser._subparsers else None
    if subcommands:
        for child in dict.fromkeys(subcommands.values()):
            _add_quiet(child)
    elif "--quiet" not in parser._option_string_actions:
        parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars or progress lines")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parser.parse_args(remote_args.decode(argv))  # `train`'s arguments across a remote shell
        return _run(args)
    except UserError as e:  # every command's bad input: one line, exit 2 (megabam/errors.py)
        print(f"megabam: error: {e}", file=sys.stderr)
        return exit_codes.BAD_INPUT


COMMANDS = {
    "train": run_train,
    "launch": run_launch,
    "plan": run_plan,
    "data": run_data,
    "eval": run_eval,
    "plot": run_plot,
    "repro": run_repro,
    "convert": run_convert,
    "config": run_config,
}


def _run(args) -> int:
    progress.set_quiet(args.quiet)
    if args.command != "train":  # train ends its start-up after the config is checked
        process.start_collecting()
    return COMMANDS[args.command](args)


def run() -> None:
    """The process entry point (`megabam`, `python -m megabam.cli`): main's code, recorded for the
    launch scripts, as the exit status."""
    process.begin()
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
