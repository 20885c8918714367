"""End-to-end training through the `megabam` command: single process, resume, and 2 data-parallel
ranks under torchrun (gloo), compared with the single-process run."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import ENV, REPO, SMALL, logged, losses, megabam_train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megabam.config import load_config
from megabam.train.window_sampler import WindowSampler

SWAX = REPO / "yaml_configs" / "swax_tiny_cpu.yaml"


def test_main_job_end_to_end(tmp_path, data_cache):
    """The main job's config at the tests' small size for 30 steps, wandb offline and TensorBoard on
    (its scalars read back with TensorBoard's own reader: the metrics.jsonl values at the same steps,
    every head's, and the two figures), then evaluated and drawn in fresh processes."""
    result = megabam_train(
        tmp_path,
        data_cache,
        "run.name=e2e",
        "train.steps=30",
        "checkpoint.every=15",
        "train.eval_every=15",
        "logging.wandb_mode=offline",
        "logging.tensorboard=true",
        "logging.plots=true",
    )
    run_dir = tmp_path / "e2e"
    assert "== megabam summary ==" in result.stdout and "passkey @ 128" in result.stdout
    assert (run_dir / "config.yaml").is_file() and (run_dir / "tokenizer.model").is_file()
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert (
        run_dir / "passkey.png"
    ).stat().st_size > 1000 and f"passkey plot    {run_dir / 'passkey.png'}" in result.stdout
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000030"
    assert (run_dir / "checkpoints" / "step_00000015" / "megabam.json").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run"
    curve = losses(run_dir)
    assert len(curve) == 30
    first, last = sum(curve[s] for s in range(1, 4)) / 3, sum(curve[s] for s in range(28, 31)) / 3
    assert last < first - 1.0, (first, last)
    assert 15 in logged(run_dir, "passkey_128") and 15 in logged(run_dir, "passkey_128_key_tokens")
    heads = logged(run_dir, "heads")[30]
    assert {"bam/layer1/head3/theta_alpha", "bam/layer1/head3/beta", "ssmax/layer1/head3/s"} <= set(heads)
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0}).Reload()
    for key in ("loss", "lr", "val_loss", "passkey_128"):
        rows = logged(run_dir, key)
        assert 30 in rows and {e.step: e.value for e in acc.Scalars(key)} == pytest.approx(rows), key
    assert set(heads) <= set(acc.Tags()["scalars"])
    for tag in ("loss", "passkey"):
        [picture] = acc.Images(tag)
        assert picture.step == 30 and picture.width > 100, tag

    # The run's DeepSpeed checkpoint evaluated and drawn in fresh processes, as a user would.
    evaluate = [sys.executable, "-m", "megabam.cli", "eval", "passkey", str(run_dir), "--lengths", "128", "256"]
    out = subprocess.run([*evaluate, "--trials", "1"], capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run_dir / "eval" / "passkey-step_00000030.json").read_text())["step"] == 30
    for kind in ("priors", "training"):
        plot = [sys.executable, "-m", "megabam.cli", "plot", kind, str(run_dir)]
        out = subprocess.run(plot, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
        assert out.returncode == 0 and Path(out.stdout.strip()).stat().st_size > 1000, out.stderr[-3000:]


def test_existing_run_is_never_overwritten(tmp_path, data_cache):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    result = megabam_train(tmp_path, data_cache, "run.name=taken", "train.steps=4", check=False)
    assert result.returncode == 2
    assert "holds files but no checkpoint" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]
    # --fresh starts beside it (logging.plots off, as in every run of these tests but the main job's:
    # no PNG, no plot line in the summary)
    fresh = megabam_train(tmp_path, data_cache, "run.name=taken", "train.steps=3", "eval.passkey_samples=0", "--fresh")
    assert (tmp_path / "taken-2" / "checkpoints" / "latest").is_file()
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]
    assert not list((tmp_path / "taken-2").glob("*.png")) and "plot " not in fresh.stdout


def test_bad_config_fails_before_work(tmp_path, data_cache):
    result = megabam_train(tmp_path, data_cache, "run.name=bad", "model.n_heads=5", check=False)
    assert result.returncode == 2
    assert result.stderr.strip().endswith("model.n_heads: 5 does not divide model.d_model=64")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    "setting", [["train.precision=bf16", "parallel.zero_stage=2", "train.grad_accum=2"]], ids=["bf16-zero2-accum2"]
)
def test_resume_continues_the_run(tmp_path, data_cache, setting):
    """Bit for bit in bf16 with ZeRO-2 and accumulation. (fp32 with ZeRO-1 in one process:
    test_resume.py's SIGTERM resume; over two ranks: its kill -9 resume.)"""
    megabam_train(tmp_path, data_cache, "run.name=full", "train.steps=12", "checkpoint.every=6", *setting)
    # A copy of the run, cut back to its step-6 checkpoint, then resumed (metrics past step 6 are
    # dropped by the trainer and recomputed).
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step_00000012")
    resumed = megabam_train(
        tmp_path, data_cache, "run.name=part", "train.steps=12", "checkpoint.every=6", *setting, resume=True
    )
    assert "resumed from" in resumed.stdout + resumed.stderr
    reference, continued = losses(tmp_path / "full"), losses(part)
    for step in range(7, 13):
        assert continued[step] == reference[step], step


def test_two_data_parallel_ranks_match_one_process(tmp_path, data_cache):
    """DP=2 with micro-batch b sees the same global batches as DP=1 with two micro-batches of b
    (streaming's sample order does not depend on the world size when num_canonical_nodes is fixed),
    so the loss curves agree up to float reduction order, ZeRO-1 sharding the optimizer state over the
    two ranks. (ZeRO-2 over two data-parallel ranks: DP=2 × TP=2 in test_parallel_train.py and
    test_convert_parallel.py.)"""
    zero = "parallel.zero_stage=1"
    one = megabam_train(
        tmp_path, data_cache, "run.name=dp1", "train.steps=6", "train.micro_batch_size=2", "train.grad_accum=2", zero
    )
    two = megabam_train(
        tmp_path, data_cache, "run.name=dp2", "train.steps=6", "train.micro_batch_size=2", zero, nproc=2
    )
    assert one.returncode == two.returncode == 0
    reference, parallel = losses(tmp_path / "dp1"), losses(tmp_path / "dp2")
    for step in range(1, 7):
        assert parallel[step] == pytest.approx(reference[step], rel=1e-4), step


def test_swax_trains_with_per_step_windows_and_resumes_exactly(tmp_path, data_cache):
    """The trainer feeds every SWA layer the sampler's window of each step, the same on both ranks
    (one process group computes one loss), and a resumed run draws the same windows."""
    windows = [
        "window.windows=[16, 64]",
        "window.probabilities=[0.5, 0.5]",
        "window.anneal_fraction=0.25",
        "model.swa.window=64",
        "model.swa.block_size=32",
        "model.mlstm.chunk_size=32",
        "train.steps=12",
        "checkpoint.every=6",
    ]
    megabam_train(tmp_path, data_cache, "run.name=swax", *windows, config=SWAX, nproc=2)
    cfg = load_config(SWAX, [*SMALL, *windows])
    sampler = WindowSampler(cfg.window, cfg.run.seed, 12)
    expected = {t + 1: sampler.window(t) for t in range(12)}
    assert logged(tmp_path / "swax", "window") == expected
    assert set(expected.values()) == {16, 64} and expected[10] == expected[11] == expected[12] == 64  # annealed
    curve = losses(tmp_path / "swax")
    assert sum(curve[s] for s in (10, 11, 12)) < sum(curve[s] for s in (1, 2, 3)) - 1.0

    part = tmp_path / "swax_part"
    shutil.copytree(tmp_path / "swax", part)
    shutil.rmtree(part / "checkpoints" / "step_00000012")
    megabam_train(tmp_path, data_cache, "run.name=swax_part", *windows, config=SWAX, nproc=2)
    assert losses(part) == curve and logged(part, "window") == expected
