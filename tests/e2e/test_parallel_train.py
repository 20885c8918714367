"""Tensor and pipeline parallelism end to end through `megabam train` under torchrun (gloo): TP=2
(with full activation recomputation), DP=2 × TP=2 (ZeRO-2, selective recomputation), PP=2 and
DP=2 × PP=2 (ZeRO-1) against the plain single-process run, one model file per tensor rank or
layer, ZeRO shards per data-parallel rank, exact resumes, and a world size the layout does not divide;
on the same runs, `megabam convert`'s consolidation (DP=2 × TP=2) and its refusal of damaged files (TP=2,
and PP=2's layer file copied over another, which the resume sets aside)."""

import shutil

import pytest
from helpers.checkpoints import resign
from helpers.consolidation import assert_consolidates_to_the_parallel_logits
from helpers.runs import losses, megabam_train

from megabam.cli import main

RUN = ["train.steps=6", "checkpoint.every=3", "train.eval_every=3"]  # micro-batch 4 (tests/runs.py SMALL)
LOSS_RTOL = 1e-5  # measured ~1e-7 (float reduction order)


def _parameters_line(result) -> str:
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("parameters")]
    return line


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    """The single-process run: losses per step and the summary's parameter count."""
    root = tmp_path_factory.mktemp("reference")
    result = megabam_train(root, data_cache, "run.name=tp1", *RUN)
    return losses(root / "tp1"), _parameters_line(result)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, data_cache):
    """TP=2 with full activation recomputation (it must not change the result either): the run's
    directory and `megabam train`'s result."""
    root = tmp_path_factory.mktemp("tp2")
    two = megabam_train(root, data_cache, "run.name=tp2", "parallel.tensor=2", "parallel.recompute=full", *RUN, nproc=2)
    return root / "tp2", two


def test_tensor_parallel_training_matches_one_process_and_resumes(tmp_path, data_cache, reference, tp2):
    reference_losses, reference_params = reference
    run, two = tp2
    assert _parameters_line(two) == reference_params  # the whole model, not rank 0's shard
    parallel = losses(run)
    assert sorted(parallel) == list(range(1, 7))
    for step in range(1, 7):
        assert parallel[step] == pytest.approx(reference_losses[step], rel=LOSS_RTOL), step
    saved = run / "checkpoints" / "step_00000006"
    assert {p.name for p in saved.glob("mp_rank_*_model_states.pt")} == {
        "mp_rank_00_model_states.pt",
        "mp_rank_01_model_states.pt",
    }

    part = tmp_path / "part"
    shutil.copytree(run, part)
    shutil.rmtree(part / "checkpoints" / "step_00000006")
    resumed = megabam_train(
        tmp_path,
        data_cache,
        "run.name=part",
        "parallel.tensor=2",
        "parallel.recompute=full",
        *RUN,
        nproc=2,
        resume=True,
    )
    assert "resumed from" in resumed.stdout + resumed.stderr
    continued = losses(part)
    for step in range(4, 7):
        assert continued[step] == parallel[step], step


def test_two_data_parallel_by_two_tensor_parallel_ranks_with_zero2_match_one_process(
    tmp_path, data_cache, reference, capsys
):
    """4 processes: TP peers read identical samples (replication 2), the two data-parallel replicas
    half of each global batch each, so micro-batch 2 reproduces the reference's micro-batch 4. Its
    checkpoint consolidates to the parallel model's logits (`megabam convert`)."""
    reference_losses, _ = reference
    megabam_train(
        tmp_path,
        data_cache,
        "run.name=dp2tp2",
        "parallel.tensor=2",
        "parallel.zero_stage=2",
        "parallel.recompute=selective",
        "train.micro_batch_size=2",
        *RUN,
        nproc=4,
    )
    parallel = losses(tmp_path / "dp2tp2")
    for step in range(1, 7):
        assert parallel[step] == pytest.approx(reference_losses[step], rel=LOSS_RTOL), step
    # ZeRO partitions the optimizer over the data-parallel group only: one shard per (dp, tp) rank.
    saved = tmp_path / "dp2tp2" / "checkpoints" / "step_00000006"
    assert {p.name for p in saved.glob("zero_pp_rank_*_optim_states.pt")} == {
        f"zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt" for dp in (0, 1) for tp in (0, 1)
    }
    assert_consolidates_to_the_parallel_logits(tmp_path / "dp2tp2", saved, 4, 2, tmp_path / "consolidated", capsys)


def test_a_missing_zero_partition_and_a_tensor_rank_file_copied_over_another_are_named(
    tmp_path, data_cache, tp2, capsys
):
    """On a copy of the TP=2 run cut back to its step-6 checkpoint, each damage with the manifest
    re-signed to match: inspect names the missing partition; every reader refuses rank 1's weights
    file when it is rank 0's (the same names and shapes, different values: merged, it gave wrong
    weights with exit 0)."""
    run = tmp_path / "tp2"
    shutil.copytree(tp2[0], run)
    shutil.rmtree(run / "checkpoints" / "step_00000003")
    ckpt = run / "checkpoints" / "step_00000006"
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
    tp = ["parallel.tensor=2", "parallel.recompute=full", *RUN[1:], "train.steps=7"]
    resumed = megabam_train(tmp_path, data_cache, "run.name=tp2", *tp, nproc=2, check=False)
    assert resumed.returncode == 2
    assert f"rank 1: its model-states file was {swapped}" in resumed.stdout + resumed.stderr


def test_world_size_that_the_layout_does_not_divide_is_refused(tmp_path, data_cache):
    result = megabam_train(tmp_path, data_cache, "run.name=bad", "parallel.tensor=4", nproc=2, check=False)
    assert result.returncode != 0
    assert "parallel.tensor: world size 2 is not a multiple of parallel.tensor · parallel.pipeline = 4" in result.stderr
    assert not (tmp_path / "bad").exists()


def test_pipeline_parallel_training_matches_one_process_and_resumes(tmp_path, data_cache, reference, capsys):
    """PP=2 through `megabam train`: the same losses and parameter count as one process, one file per
    layer (the tied embedding once, by the first stage), and an exact resume from the middle past a
    newer checkpoint whose layer file was copied over another's."""
    reference_losses, reference_params = reference
    run = ["parallel.pipeline=2", "parallel.recompute=full", *RUN]
    two = megabam_train(tmp_path, data_cache, "run.name=pp2", *run, nproc=2)
    assert _parameters_line(two) == reference_params
    assert "passkey @ 128" in two.stdout  # scored through the stages
    parallel = losses(tmp_path / "pp2")
    for step in range(1, 7):
        assert parallel[step] == pytest.approx(reference_losses[step], rel=LOSS_RTOL), step
    saved = tmp_path / "pp2" / "checkpoints" / "step_00000006"
    # embedding, two blocks, final norm (layers 0-3); the head is the tied embedding, not saved twice
    assert {p.name for p in saved.glob("layer_*")} == {f"layer_{i:02d}-model_00-model_states.pt" for i in range(4)}

    # A copy whose step-6 checkpoint has block 0's file (pipeline layer 1) copied over block 1's (layer
    # 2: the same tensor names and shapes), manifest re-signed, and no summary (as if killed before it
    # was written): convert refuses the checkpoint, and the resume sets it aside and continues from
    # step 3 exactly.
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "pp2", part)
    (part / "summary.json").unlink()
    swapped_ckpt = part / "checkpoints" / "step_00000006"
    shutil.copy(swapped_ckpt / "layer_01-model_00-model_states.pt", swapped_ckpt / "layer_02-model_00-model_states.pt")
    resign(swapped_ckpt)
    swapped = (
        "written as layer 1 of tensor rank 0 of a tensor=1, pipeline=2 layout, not layer 2 of tensor rank 0 of a "
        "tensor=1, pipeline=2 layout (a file copied over another?)"
    )
    assert main(["convert", "inspect", str(swapped_ckpt)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"layer_02-model_00-model_states.pt: {swapped}")
    resumed = megabam_train(tmp_path, data_cache, "run.name=part", *run, nproc=2, resume=True)
    out = resumed.stdout + resumed.stderr
    assert f"layer 2's file was {swapped}" in out and "set aside as .unusable-step_00000006" in out
    assert "resumed from" in out and "step_00000003 at step 3" in out
    continued = losses(part)
    for step in range(4, 7):
        assert continued[step] == parallel[step], step


def test_two_data_parallel_by_two_pipeline_ranks_with_zero1_match_one_process(tmp_path, data_cache, reference):
    """4 processes: pipeline peers read identical samples, the two replicas half of each global batch;
    ZeRO-1 shards the optimizer over the data-parallel group of each stage."""
    reference_losses, _ = reference
    megabam_train(
        tmp_path,
        data_cache,
        "run.name=dp2pp2",
        "parallel.pipeline=2",
        "parallel.zero_stage=1",
        "train.micro_batch_size=2",
        *RUN,
        nproc=4,
    )
    parallel = losses(tmp_path / "dp2pp2")
    for step in range(1, 7):
        assert parallel[step] == pytest.approx(reference_losses[step], rel=LOSS_RTOL), step
