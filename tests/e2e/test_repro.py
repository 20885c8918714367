"""`megabam repro` end to end at a reduced size (one seed, few steps): every arm trained and
evaluated, the table and figure written, and a rerun skipping what is finished."""

import json
import subprocess
import sys

from helpers.runs import ENV, REPO, SMALL


def repro(tmp_path, data_cache, *extra):
    cmd = [sys.executable, "-m", "megabam.cli", "repro", "bam", *SMALL, f"data.cache_dir={data_cache}"]
    cmd += ["--arms", "ggd_ssmax", "ggd_ssmax_radam_shared", "--seeds", "0", "--steps", "3", "--lengths", "1", "2"]
    cmd += ["--depths", "0.5", "--trials", "1", "--out", str(tmp_path / "repro"), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_repro_trains_evaluates_and_resumes(tmp_path, data_cache):
    """The second arm trains with RAdam and one prior shared by the layers (the BAM reference's
    recipe) through DeepSpeed's ZeRO-1, as any arm."""
    out = tmp_path / "repro"
    first = repro(tmp_path, data_cache)
    assert "[1/2] ggd_ssmax seed 0: trained and evaluated" in first.stderr
    assert "[2/2] ggd_ssmax_radam_shared seed 0: trained and evaluated" in first.stderr
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"ggd_ssmax", "ggd_ssmax_radam_shared"}
    radam = results["ggd_ssmax_radam_shared"]["0"]
    assert set(radam["passkey"]) == {"1", "2"} and radam["step"] == 3
    # one depth, one prompt: the per-depth count (the SWAX table's past-the-window column) is the score
    assert {m: [score] for m, score in radam["passkey"].items()} == radam["passkey_by_depth"]
    assert "| ggd_ssmax | 1 | 1 | " in (out / "results.md").read_text()  # 1 seed, 1 prompt per length
    assert (out / "bam.png").stat().st_size > 1000
    assert (out / "plots" / "ggd_ssmax-seed0-training.png").stat().st_size > 1000
    log = (out / "train.log").read_text()
    assert log.count("$ ") == 2

    # A rerun reuses the finished run's result and evaluates the run trained to the end but not
    # evaluated (say, interrupted during evaluation), retraining neither. (Each case of the rerun's
    # choice, other lengths included: tests/unit/test_repro_steps.py.)
    (out / "ggd_ssmax_radam_shared-seed0" / "eval" / "repro.json").unlink()
    again = repro(tmp_path, data_cache)
    assert "[1/2] ggd_ssmax seed 0: done before" in again.stderr
    assert "[2/2] ggd_ssmax_radam_shared seed 0: evaluated" in again.stderr
    assert json.loads((out / "results.json").read_text()) == results
    assert (out / "train.log").read_text() == log, "a finished run was trained again"


def test_repro_refuses_unknown_arms_in_one_line(tmp_path):
    cmd = [sys.executable, "-m", "megabam.cli", "repro", "bam", "--arms", "ggd_ssmax", "xpos", "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "unknown arm(s) xpos" in result.stderr


def test_an_arm_that_fails_to_train_is_one_line_naming_its_log(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    cmd = [sys.executable, "-m", "megabam.cli", "repro", "bam", *SMALL, f"data.cache_dir={blocker}"]
    cmd += ["--arms", "alibi", "--seeds", "0", "--steps", "2", "--out", str(tmp_path / "repro")]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert "training alibi-seed0 failed (exit 2)" in line and str(tmp_path / "repro" / "train.log") in line
