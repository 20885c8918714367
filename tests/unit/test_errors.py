"""One user-error type (megabam/errors.py): every error a command reports as bad input derives from
it, and the CLI turns any of them, raised anywhere under any command, into one line and exit 2."""

import pytest

import megabam.cli
from megabam.cli import main
from megabam.config import ConfigError
from megabam.convert.output import OutputError
from megabam.data.errors import DataError
from megabam.data.passkey import PromptTooShort
from megabam.data.prepare import WorkerLost
from megabam.errors import UserError
from megabam.eval.cli import BadArgument
from megabam.eval.plots import NothingToPlot
from megabam.train.checkpoint import CheckpointError, NewerMeta
from megabam.train.run_lock import RunDirError


def test_every_bad_input_error_is_a_user_error():
    for cls in (ConfigError, DataError, CheckpointError, NewerMeta, OutputError, RunDirError, BadArgument):
        assert issubclass(cls, UserError), cls
    for cls in (NothingToPlot, PromptTooShort, WorkerLost):
        assert issubclass(cls, UserError), cls


@pytest.mark.parametrize("error", [DataError("x.parquet: no column 'text'"), RunDirError("runs/a: in use")])
def test_the_cli_reports_a_user_error_from_any_command_as_one_line(monkeypatch, capsys, error):
    def failing(args):
        raise error

    monkeypatch.setattr(megabam.cli, "run_plan", failing)
    assert main(["plan", "any.yaml", "--gpu", "h100-80gb"]) == 2
    assert capsys.readouterr().err == f"megabam: error: {error}\n"
