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
