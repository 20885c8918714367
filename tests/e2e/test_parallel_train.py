"""Tensor and pipeline parallelism end to end through `megabam train` under torchrun (gloo): TP=2
(with full activation recomputation), DP=2 × TP=2 (ZeRO-2, selective recomputation), PP=2 and
DP=2 × PP=2 (ZeRO-1) against the plain single-process run, one model file per tensor rank or
layer, ZeRO shards per data-parallel rank, exact resumes, and a world size the layout does not divide."""

import shutil

import pytest
from helpers.runs import losses, megabam_train

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


def test_tensor_parallel_training_matches_one_process_and_resumes(tmp_path, data_cache, reference):
    reference_losses, reference_params = reference
    # with full activation recomputation on top: it must not change the result either
    two = megabam_train(
        tmp_path, data_cache, "run.name=tp2", "parallel.tensor=2", "parallel.recompute=full", *RUN, nproc=2
    )
    assert _parameters_line(two) == reference_params  # the whole model, not rank 0's shard
    parallel = losses(tmp_path / "tp2")
    assert sorted(parallel) == list(range(1, 7))
    for step in range(1, 7):
        assert parallel[step] == pytest.approx(reference_losses[step], rel=LOSS_RTOL), step
    saved = tmp_path / "tp2" / "checkpoints" / "step_00000006"
    assert {p.name for p in saved.glob("mp_rank_*_model_states.pt")} == {
        "mp_rank_00_model_states.pt",
        "mp_rank_01_model_states.pt",
    }

    part = tmp_path / "part"
    shutil.copytree(tmp_path / "tp2", part)
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


def test_two_data_parallel_by_two_tensor_parallel_ranks_with_zero2_match_one_process(tmp_path, data_cache, reference):
    """4 processes: TP peers read identical samples (replication 2), the two data-parallel replicas
    half of each global batch each, so micro-batch 2 reproduces the reference's micro-batch 4."""
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


def test_world_size_that_the_layout_does_not_divide_is_refused(tmp_path, data_cache):
    result = megabam_train(tmp_path, data_cache, "run.name=bad", "parallel.tensor=4", nproc=2, check=False)
    assert result.returncode != 0
    assert "parallel.tensor: world size 2 is not a multiple of parallel.tensor · parallel.pipeline = 4" in result.stderr
    assert not (tmp_path / "bad").exists()


def test_pipeline_parallel_training_matches_one_process_and_resumes(tmp_path, data_cache, reference):
    """PP=2 through `megabam train`: the same losses and parameter count as one process, one file per
    layer (the tied embedding once, by the first stage), and an exact resume from the middle."""
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

    part = tmp_path / "part"
    shutil.copytree(tmp_path / "pp2", part)
    shutil.rmtree(part / "checkpoints" / "step_00000006")
    resumed = megabam_train(tmp_path, data_cache, "run.name=part", *run, nproc=2, resume=True)
    assert "resumed from" in resumed.stdout + resumed.stderr
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
