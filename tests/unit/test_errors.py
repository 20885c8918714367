"""One user-error type (megabam/errors.py): every error a command reports as bad input derives from
it, and the CLI turns any of them, raised anywhere under any command, into one line and exit 2."""

import pickle
from pathlib import Path

import pytest

import megabam.cli
from megabam.checkpoint.store import CheckpointError, NewerMeta
from megabam.cli import main
from megabam.config import ConfigError
from megabam.data.errors import DataError
from megabam.data.passkey import PromptTooShort
from megabam.data.prepare import WorkerLost
from megabam.errors import BadArgument, LaunchError, UserError
from megabam.eval.plots import NothingToPlot
from megabam.staging import OutputError
from megabam.train.run_lock import RunDirError


def test_every_bad_input_error_is_a_user_error():
    for cls in (ConfigError, DataError, CheckpointError, NewerMeta, OutputError, RunDirError, BadArgument):
        assert issubclass(cls, UserError), cls
    for cls in (NothingToPlot, PromptTooShort, WorkerLost, LaunchError):
        assert issubclass(cls, UserError), cls


def test_a_user_error_names_source_key_and_message_and_survives_pickling():
    """What a program catching it reads (source, key, message), what a user reads (one line, the parts
    that are there), and the same error after crossing a process boundary (multiprocessing pickles it)."""
    cases = [
        (
            ConfigError("a.yaml", "optim.lr", "expected a number, got 'x'"),
            "a.yaml: optim.lr: expected a number, got 'x'",
        ),
        (DataError("x.parquet", None, "no column 'text'"), "x.parquet: no column 'text'"),
        (BadArgument(None, "--device", "'banana' is not a torch device"), "--device: 'banana' is not a torch device"),
        (
            LaunchError("environment", "MASTER_PORT", "must be a TCP port"),
            "environment: MASTER_PORT: must be a TCP port",
        ),
    ]
    for error, line in cases:
        assert str(error) == line
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == line
        assert (again.source, again.key, again.message) == (error.source, error.key, error.message)
    assert DataError(Path("/d/x"), None, "m").source == "/d/x"  # a path given as the source is kept as text


@pytest.mark.parametrize(
    "error", [DataError("x.parquet", None, "no column 'text'"), RunDirError("runs/a", None, "in use")]
)
def test_the_cli_reports_a_user_error_from_any_command_as_one_line(monkeypatch, capsys, error):
    def failing(args):
        raise error

    monkeypatch.setitem(megabam.cli.COMMANDS, "plan", failing)
    assert main(["plan", "any.yaml", "--gpu", "h100-80gb"]) == 2
    assert capsys.readouterr().err == f"megabam: error: {error}\n"
