"""`megabam convert` on checkpoints that real parallel training wrote (DeepSpeed under torchrun,
gloo): TP=2 × PP=2 (per-layer files, ZeRO-1) here; DP=2 × TP=2 with ZeRO-2, TP=2's damaged files and
PP=2's layer file copied over another, on test_parallel_train.py's runs. The consolidated folder's
one-process model must give the logits that the parallel model computes after DeepSpeed itself loads
the same checkpoint (tests/helpers/consolidation.py)."""

import pytest
from helpers.consolidation import assert_consolidates_to_the_parallel_logits
from helpers.runs import logged, megabam_train

from megabam.cli import main

TP2PP2 = ["parallel.tensor=2", "parallel.pipeline=2", "parallel.zero_stage=1"]


def test_consolidated_model_gives_the_parallel_models_logits(tmp_path, data_cache, capsys):
    megabam_train(tmp_path, data_cache, "run.name=tp2pp2", "train.steps=3", "checkpoint.every=3", *TP2PP2, nproc=4)
    ckpt = tmp_path / "tp2pp2" / "checkpoints" / "step_00000003"
    assert_consolidates_to_the_parallel_logits(tmp_path / "tp2pp2", ckpt, 4, 1, tmp_path / "consolidated", capsys)


def test_a_new_run_starts_from_a_consolidated_folder(tmp_path, data_cache):
    """train.init_from: the new run computes with the folder's weights (its validation loss after one
    step at a learning rate of 1e-12 is the source run's final one), optimizer and data fresh."""
    megabam_train(tmp_path, data_cache, "run.name=source", "train.steps=3", "checkpoint.every=3", "train.eval_every=1")
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
    # The source's validation loss moved while it trained, so a new run that had not loaded the folder
    # (the same seed's initial weights) would not match it.
    assert source[1] != pytest.approx(source[3], rel=1e-3)
