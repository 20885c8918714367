"""`megabam config diff A B`: where two configs differ, each a YAML file (its `defaults:` read) or a run
directory (its resolved config.yaml)."""

from pathlib import Path

from megabam import exit_codes
from megabam.config.loader import config_differences, config_to_dict, load_config
from megabam.errors import BadArgument


def add_config_parser(sub) -> None:
    config = sub.add_parser("config", help="compare configs", description=__doc__)
    commands = config.add_subparsers(dest="config_command", required=True)
    diff = commands.add_parser(
        "diff",
        help="the keys where two configs differ",
        description="Print each key whose value differs between A and B (defaults filled in on both sides); exit 0 "
        "when none differs, 1 when some do (as diff does).",
    )
    diff.add_argument("a", help="a YAML config or a run directory")
    diff.add_argument("b", help="a YAML config or a run directory")


def run_config(args) -> int:
    a, b = (config_to_dict(load_config(_config_file(x))) for x in (args.a, args.b))
    differences = config_differences(a, b)
    for key, x, y in differences:
        print(f"{key}: {x!r} → {y!r}")
    if not differences:
        print(f"{args.a} and {args.b} give the same config")
    return 1 if differences else exit_codes.OK


def _config_file(given: str) -> Path:
    path = Path(given)
    if path.is_dir():
        if not (path / "config.yaml").is_file():
            raise BadArgument(path, None, "a directory without config.yaml (not a run directory?)")
        return path / "config.yaml"
    return path
