"""`megabam convert` on checkpoints that real parallel training wrote (DeepSpeed under torchrun,
gloo): TP=2 × PP=2 (per-layer files, ZeRO-1) and DP=2 × TP=2 with ZeRO-2. The consolidated folder's
one-process model must give the logits that the parallel model computes after DeepSpeed itself loads
the same checkpoint (tests/helpers/parallel_logits.py), within 1e-5 in fp32."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers.checkpoints import resign
from helpers.parallel_logits import token_ids
from helpers.runs import ENV, REPO, logged, megabam_train

from megabam.checkpoint.consolidated import read_consolidated
from megabam.cli import main

LOGITS_ATOL = 1e-5  # measured 3.6e-7 (TP=2 × PP=2), logits of size ~1

LAYOUTS = {
    "tp2pp2": ["parallel.tensor=2", "parallel.pipeline=2", "parallel.zero_stage=1"],
    "dp2tp2_zero2": ["parallel.tensor=2", "parallel.zero_stage=2", "train.micro_batch_size=2"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_consolidated_model_gives_the_parallel_models_logits(tmp_path, data_cache, layout, capsys):
    megabam_train(
        tmp_path, data_cache, f"run.name={layout}", "train.steps=3", "checkpoint.every=3", *LAYOUTS[layout], nproc=4
    )
    ckpt = tmp_path / layout / "checkpoints" / "step_00000003"
    reference = tmp_path / "parallel_logits.pt"
    helper = REPO / "tests" / "helpers" / "parallel_logits.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(helper)]
    result = subprocess.run([*cmd, str(ckpt), str(reference)], capture_output=True, text=True, env=ENV, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]

    assert main(["convert", "inspect", str(tmp_path / layout), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layout"]["data"] == (2 if layout.startswith("dp2") else 1)
    assert report["optimizer_state"]["present"] and len(report["optimizer_state"]["files"]) == 4
    assert report["optimizer_state"]["expected"] == 4 and report["optimizer_state"]["missing"] == []

    out = tmp_path / "consolidated"
    assert main(["convert", "consolidate", str(tmp_path / layout), str(out)]) == 0
    folder = read_consolidated(out)
    with torch.no_grad():
        logits = folder.model.eval()(token_ids(folder.config.model.vocab_size))
    expected = torch.load(reference, weights_only=True)
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() < LOGITS_ATOL
    if layout == "tp2pp2":
        _a_pipeline_layer_file_copied_over_another_is_refused(tmp_path, data_cache, ckpt, capsys)


def _a_pipeline_layer_file_copied_over_another_is_refused(tmp_path, data_cache, ckpt, capsys):
    """Blocks 0 and 1 (pipeline layers 1 and 2) have the same tensor names and shapes: a copy of one
    over the other, manifest re-signed, is refused by convert and by a resuming training run."""
    shutil.copy(ckpt / "layer_01-model_00-model_states.pt", ckpt / "layer_02-model_00-model_states.pt")
    resign(ckpt)
    swapped = (
        "written as layer 1 of tensor rank 0 of a tensor=2, pipeline=2 layout, not layer 2 of tensor rank 0 of a "
        "tensor=2, pipeline=2 layout (a file copied over another?)"
    )
    assert main(["convert", "inspect", str(ckpt)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"layer_02-model_00-model_states.pt: {swapped}")
    resumed = megabam_train(
        tmp_path,
        data_cache,
        "run.name=tp2pp2",
        "train.steps=4",
        "checkpoint.every=3",
        *LAYOUTS["tp2pp2"],
        nproc=4,
        check=False,
    )
    assert resumed.returncode == 2
    assert f"layer 2's file was {swapped}" in resumed.stdout + resumed.stderr


def test_a_new_run_starts_from_a_consolidated_folder(tmp_path, data_cache):
    """train.init_from: the new run computes with the folder's weights (its validation loss after one
    step at a learning rate of 1e-12 is the source run's final one), optimizer and data fresh."""
    megabam_train(tmp_path, data_cache, "run.name=source", "train.steps=3", "checkpoint.every=3")
    assert main(["convert", "consolidate", str(tmp_path / "source"), str(tmp_path / "folder")]) == 0
    result = megabam_train(
        tmp_path,
        data_cache,
        "run.name=continued",
        "train.steps=1",
        "schedule.warmup_steps=0",
        "optim.lr=1e-12",
        f"train.init_from={tmp_path / 'folder'}",
    )
    assert (
        "the optimizer, schedule and data start fresh; WARNING: schedule.warmup_steps=0"
        in result.stdout + result.stderr
    )
    source, continued = logged(tmp_path / "source", "val_loss"), logged(tmp_path / "continued", "val_loss")
    assert continued[1] == pytest.approx(source[3], rel=1e-6)
    fresh = megabam_train(tmp_path, data_cache, "run.name=fresh", "train.steps=1", "schedule.warmup_steps=0")
    assert fresh.returncode == 0 and logged(tmp_path / "fresh", "val_loss")[1] != pytest.approx(source[3], rel=1e-3)


def test_a_missing_zero_partition_and_a_tensor_rank_file_copied_over_another_are_named(tmp_path, data_cache, capsys):
    """Both with a manifest re-signed to match: inspect names the missing partition; every reader refuses
    rank 1's weights file when it is rank 0's (the same names and shapes, different values: merged, it
    gave wrong weights with exit 0)."""
    megabam_train(tmp_path, data_cache, "run.name=tp", "train.steps=3", "parallel.tensor=2", nproc=2)
    ckpt = tmp_path / "tp" / "checkpoints" / "step_00000003"
    gone = sorted(ckpt.glob("*optim_states.pt"))[-1]
    gone.rename(tmp_path / gone.name)
    resign(ckpt)
    capsys.readouterr()
    assert main(["convert", "inspect", str(ckpt)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("optimizer"))
    assert line.endswith(f"present (1 of 2 ZeRO partition files); missing: {gone.name}")
    (tmp_path / gone.name).rename(gone)

    shutil.copy(ckpt / "mp_rank_00_model_states.pt", ckpt / "mp_rank_01_model_states.pt")
    resign(ckpt)
    swapped = (
        "written as tensor rank 0 of a tensor=2, pipeline=1 layout, not tensor rank 1 of a tensor=2, pipeline=1 "
        "layout (a file copied over another?)"
    )
    for cmd in (["inspect", str(ckpt)], ["consolidate", str(ckpt), str(tmp_path / "out")]):
        assert main(["convert", *cmd]) == 2
        (err,) = capsys.readouterr().err.strip().splitlines()
        assert err.endswith(f"mp_rank_01_model_states.pt: {swapped}"), err
    assert not (tmp_path / "out").exists()
    # Training does not resume from it either: the checkpoint is set aside (it was the only one).
    resumed = megabam_train(
        tmp_path, data_cache, "run.name=tp", "train.steps=4", "parallel.tensor=2", nproc=2, check=False
    )
    assert resumed.returncode == 2
    assert f"rank 1: its model-states file was {swapped}" in resumed.stdout + resumed.stderr
