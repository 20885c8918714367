"""The consolidation check shared by the parallel-training tests: `megabam convert` on a checkpoint
that real parallel training wrote gives a one-process model whose logits are the ones the parallel
model computes after DeepSpeed itself loads the same checkpoint (tests/helpers/parallel_logits.py),
within 1e-5 in fp32."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from helpers.parallel_logits import token_ids
from helpers.runs import ENV, REPO
from megabam.checkpoint.consolidated import read_consolidated
from megabam.cli import main

LOGITS_ATOL = 1e-5  # measured 3.6e-7 (TP=2 × PP=2), logits of size ~1


def assert_consolidates_to_the_parallel_logits(run_dir: Path, ckpt: Path, nproc: int, data: int, out: Path, capsys):
    """Inspect reports the layout (`data` replicas) and one ZeRO file per rank; the consolidated
    folder (written to `out`) computes the parallel model's logits."""
    reference = out.with_name(out.name + "-parallel-logits.pt")
    helper = REPO / "tests" / "helpers" / "parallel_logits.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(helper)]
    result = subprocess.run([*cmd, str(ckpt), str(reference)], capture_output=True, text=True, env=ENV, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]

    capsys.readouterr()
    assert main(["convert", "inspect", str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layout"]["data"] == data
    assert report["optimizer_state"]["present"] and len(report["optimizer_state"]["files"]) == nproc
    assert report["optimizer_state"]["expected"] == nproc and report["optimizer_state"]["missing"] == []

    assert main(["convert", "consolidate", str(run_dir), str(out)]) == 0
    folder = read_consolidated(out)
    with torch.no_grad():
        logits = folder.model.eval()(token_ids(folder.config.model.vocab_size))
    expected = torch.load(reference, weights_only=True)
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() < LOGITS_ATOL
