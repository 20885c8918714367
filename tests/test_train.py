"""End-to-end training through the `megabam` command: single process, resume, and 2 data-parallel
ranks under torchrun (gloo), compared with the single-process run."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "yaml_configs" / "tiny_cpu.yaml"
# Small enough to run in seconds, large enough that the loss must fall.
SMALL = ["model.d_model=64", "model.n_layers=2", "data.seq_len=128", "data.corpus_bytes=1000000",
         "train.micro_batch_size=4", "schedule.warmup_steps=3", "train.eval_batches=2",
         "logging.log_every=1", "logging.progress_bar=false",
         "eval.passkey_samples=2", "eval.passkey_lengths=[]"]


def megabam_train(run_root: Path, cache: Path, *overrides, resume=False, nproc=1, check=True):
    args = [f"run.output_dir={run_root}", f"data.cache_dir={cache}", *SMALL, *overrides]
    if nproc == 1:
        cmd = [sys.executable, "-m", "megabam.cli", "train", str(CONFIG), *args]
    else:  # through the repo's own launch script, as a user would
        cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), str(nproc), str(CONFIG), *args]
    if resume:
        cmd.append("--resume")
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGABAM_PYTHON=sys.executable)
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_main_job_end_to_end(tmp_path, data_cache):
    result = megabam_train(tmp_path, data_cache, "run.name=e2e", "train.steps=30", "checkpoint.every=15",
                           "train.eval_every=15")
    run_dir = tmp_path / "e2e"
    assert "== megabam summary ==" in result.stdout and "passkey @ 128" in result.stdout
    assert (run_dir / "config.yaml").is_file() and (run_dir / "tokenizer.model").is_file()
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000030"
    assert (run_dir / "checkpoints" / "step_00000015" / "megabam.json").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run"
    curve = losses(run_dir)
    assert len(curve) == 30
    first, last = sum(curve[s] for s in range(1, 4)) / 3, sum(curve[s] for s in range(28, 31)) / 3
    assert last < first - 1.0, (first, last)


def test_existing_run_is_never_overwritten(tmp_path, data_cache):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    result = megabam_train(tmp_path, data_cache, "run.name=taken", "train.steps=4", check=False)
    assert result.returncode == 2
    assert "already holds a run" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert (tmp_path / "taken" / "notes.txt").read_text() == "keep me"


def test_bad_config_fails_before_work(tmp_path, data_cache):
    result = megabam_train(tmp_path, data_cache, "run.name=bad", "model.n_heads=5", check=False)
    assert result.returncode == 2
    assert result.stderr.strip().endswith("model.n_heads: 5 does not divide model.d_model=64")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("setting", [[], ["train.precision=bf16", "parallel.zero_stage=2", "train.grad_accum=2"]],
                         ids=["fp32-zero1", "bf16-zero2-accum2"])
def test_resume_continues_the_run(tmp_path, data_cache, setting):
    megabam_train(tmp_path, data_cache, "run.name=full", "train.steps=12", "checkpoint.every=6", *setting)
    # A copy of the run, cut back to its step-6 checkpoint, then resumed.
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    (part / "checkpoints" / "latest").write_text("step_00000006")
    shutil.rmtree(part / "checkpoints" / "step_00000012")
    kept = [line for line in (part / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 6]
    (part / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    resumed = megabam_train(tmp_path, data_cache, "run.name=part", "train.steps=12", "checkpoint.every=6",
                            *setting, resume=True)
    assert "resumed from" in resumed.stdout + resumed.stderr
    reference, continued = losses(tmp_path / "full"), losses(part)
    for step in range(7, 13):
        assert continued[step] == reference[step], step


def test_two_data_parallel_ranks_match_one_process(tmp_path, data_cache):
    """DP=2 with micro-batch b sees the same global batches as DP=1 with micro-batch 2b (streaming's
    sample order does not depend on the world size when num_canonical_nodes is fixed), so the loss
    curves agree up to float reduction order."""
    one = megabam_train(tmp_path, data_cache, "run.name=dp1", "train.steps=6", "train.micro_batch_size=4")
    two = megabam_train(tmp_path, data_cache, "run.name=dp2", "train.steps=6", "train.micro_batch_size=2",
                        nproc=2)
    assert one.returncode == two.returncode == 0
    reference, parallel = losses(tmp_path / "dp1"), losses(tmp_path / "dp2")
    for step in range(1, 7):
        assert parallel[step] == pytest.approx(reference[step], rel=1e-4), step
