"""The `megabam` command's help texts and config listing (through the installed console script)."""

import subprocess
import sys
from pathlib import Path

import pytest

MEGABAM = str(Path(sys.executable).parent / "megabam")


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"]])
def test_help(args):
    result = subprocess.run([MEGABAM, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "usage: megabam" in result.stdout


def test_help_config_lists_every_section():
    result = subprocess.run(
        [sys.executable, "-m", "megabam.cli", "train", "x.yaml", "--help-config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    for key in [
        "model.attention.bam.init",
        "optim.prior_lr_mult",
        "schedule.kind",
        "data.seq_len",
        "eval.passkey_lengths",
    ]:
        assert key in result.stdout


def test_help_config_needs_no_config_file():
    """The README's example: `megabam train --help-config`."""
    result = subprocess.run([MEGABAM, "train", "--help-config"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "optim.prior_lr_mult" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["train"], "train needs a CONFIG file"),
        (["train", "yaml_configs/tiny_cpu.yaml", "--fresh", "--resume"], "--fresh (start a new run) and --resume"),
    ],
    ids=["no-config", "fresh-and-resume"],
)
def test_contradictory_or_missing_arguments_are_one_line_errors(tmp_path, args, message):
    result = subprocess.run([MEGABAM, *args], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert result.returncode == 2
    assert result.stderr.strip().startswith(f"megabam: error: {message}") and len(result.stderr.splitlines()) == 1
