"""How many steps `megabam repro` trains each run for: the study's default, a train.steps override,
or --steps, in that order of precedence."""

import json

import pytest

import megabam.eval.repro as repro
from megabam.cli import main


@pytest.mark.parametrize(
    ("study", "extra", "steps"),
    [
        ("bam", [], 1200),  # the study's default (twice the main job's 600)
        ("bam", ["train.steps=900"], 900),  # an override wins over the study's default
        ("bam", ["train.steps=900", "--steps", "50"], 50),  # --steps wins over both
        ("swax", [], 1500),  # no study default: yaml_configs/swax_tiny_cpu.yaml's train.steps
    ],
)
def test_steps_per_run(monkeypatch, tmp_path, study, extra, steps):
    seen = {}

    def record(name, out, arms, seeds, multiples, depths, trials, overrides, steps, say, average):
        seen["steps"] = steps
        return []

    monkeypatch.setattr(repro, "reproduce", record)
    assert main(["repro", study, *extra, "--out", str(tmp_path)]) == 0
    assert seen["steps"] == steps


def test_a_repro_runs_progress_is_the_last_complete_metrics_row(tmp_path):
    from megabam.eval.repro import last_step

    metrics = tmp_path / "metrics.jsonl"
    assert last_step(metrics) == 0  # not yet written
    metrics.write_text('{"step": 10, "loss": 3.0}\n{"step": 20, "loss": 2.5}\n{"step": 3')  # a row being written
    assert last_step(metrics) == 20


def test_the_table_gives_each_score_its_bootstrap_interval_over_seeds_and_prompts(monkeypatch, tmp_path):
    """Three seeds scored on 20 prompts (5 depths × 4 trials, the default grid): 20/20, 14/20 and
    0/20 retrieved at 1×. The cell is the mean of the seeds' means with the interval of stats.py
    over those very prompts (1s and 0s), the prompts column the 20, the loss its mean and range; and
    the default grid is those 20 prompts."""
    from megabam.eval.stats import bootstrap_mean

    evaluation = repro.evaluation([1], [0.0, 0.25, 0.5, 0.75, 1.0], 4)
    scores = {0: 1.0, 1: 0.7, 2: 0.0}
    results = {
        "ggd": {s: {"evaluation": evaluation, "passkey": {"1": p}, "val_loss": 2 + s} for s, p in scores.items()}
    }
    (head, _, row) = repro.summarise(results, [1], niah=False)
    assert head == "| arm | seeds | prompts | passkey 1× | val loss |"
    expected = bootstrap_mean([[1.0] * 20, [1.0] * 14 + [0.0] * 6, [0.0] * 20])
    assert expected.low < 0.3 and expected.high > 0.7 and f"{expected.mean:.2f}" == "0.57"
    assert row == f"| ggd | 3 | 20 | {expected} | 3.000 (2.000–4.000) |"

    seen = {}
    monkeypatch.setattr(repro, "reproduce", lambda *args, **kwargs: seen.update(depths=args[5], trials=args[6]) or [])
    assert main(["repro", "bam", "--out", str(tmp_path)]) == 0
    assert len(seen["depths"]) * seen["trials"] == 20 and min(seen["depths"]) == 0.0 and max(seen["depths"]) == 1.0


def test_a_rerun_reuses_trains_or_evaluates_each_run_by_what_is_on_disk(monkeypatch, tmp_path):
    """Per run: a cached result scored with this evaluation is reused; a run trained to the end whose
    result is missing, or was scored at other lengths, is evaluated again without training; any other
    run is trained, then evaluated. (tests/e2e/test_repro.py runs the real training and scoring.)"""
    trained, scored = [], []

    def train_run(study, arm, seed, out, overrides, log, steps):
        trained.append(arm)
        latest = out / repro.run_name(arm, seed) / "checkpoints" / "latest"
        latest.parent.mkdir(parents=True)
        latest.write_text(f"step_{steps:08d}\n")

    def evaluate_run(run_dir, multiples, depths, trials, niah, average):
        scored.append(run_dir.name)
        passkey = {str(m): 1.0 for m in multiples}
        return {"evaluation": repro.evaluation(multiples, depths, trials, average), "passkey": passkey, "val_loss": 2.0}

    monkeypatch.setattr(repro, "train_run", train_run)
    monkeypatch.setattr(repro, "evaluate_run", evaluate_run)
    monkeypatch.setattr(repro, "draw", lambda results, multiples, title, out: out)
    said = []
    arms = ["ggd", "alibi", "rope"]

    def run(lengths, average=1):
        for seen in (trained, scored, said):
            seen.clear()
        repro.reproduce("bam", tmp_path, arms, [0], lengths, [0.5], 1, [], 3, say=said.append, average=average)
        return [line.split(":")[1].split(" in ")[0].strip() for line in said]

    assert run([1, 2]) == ["trained and evaluated"] * 3 and trained == arms
    (tmp_path / "alibi-seed0" / "eval" / "repro.json").unlink()  # say, killed while scoring
    cached = tmp_path / "rope-seed0" / "eval" / "repro.json"
    result = json.loads(cached.read_text())
    result["evaluation"]["lengths"] = [1]  # scored at other lengths
    cached.write_text(json.dumps(result))
    assert run([1, 2]) == ["done before", "evaluated", "evaluated"]
    assert trained == [] and scored == ["alibi-seed0", "rope-seed0"]
    assert run([1, 3]) == ["evaluated"] * 3 and trained == []  # other lengths than every cached result
    assert run([1, 3], average=3) == ["evaluated"] * 3 and trained == []  # the mean of checkpoints instead
    assert run([1, 3], average=3) == ["done before"] * 3
    assert "mean of its last 3 checkpoints" in (tmp_path / "results.md").read_text()
    # Results written before averaging existed scored the final checkpoint: they answer average 1.
    assert repro.evaluation([1], [0.5], 1, 1) == {"lengths": [1], "depths": [0.5], "trials": 1}


def test_swax_tables_score_the_prompts_past_the_window_from_the_per_depth_counts():
    """Depths 0, 50 and 100 %, two prompts each, at 1× and 4×: the depth-100 % prompts (needle just
    before the question, inside any window) are left out of the extra 4× column, and only there."""
    from megabam.eval.stats import bootstrap_mean

    evaluation = repro.evaluation([1, 4], [0.0, 0.5, 1.0], 2)
    by_depth = {0: {"1": [2, 2, 2], "4": [1, 0, 2]}, 1: {"1": [2, 1, 2], "4": [0, 0, 2]}}
    results = {
        "short_16": {
            seed: {
                "evaluation": evaluation,
                "passkey": {m: sum(row) / 6 for m, row in rows.items()},
                "passkey_by_depth": rows,
                "val_loss": 1.0,
            }
            for seed, rows in by_depth.items()
        }
    }
    head, _, row = repro.summarise(results, [1, 4], niah=False, past_window=True)
    assert head == "| arm | seeds | prompts | passkey 1× | passkey 4× | passkey depth < 100 % 4× | val loss |"
    all_4x = bootstrap_mean([[1.0] * 3 + [0.0] * 3, [1.0] * 2 + [0.0] * 4])
    past = bootstrap_mean([[1.0] + [0.0] * 3, [0.0] * 4])  # seed 0: 1 of its 4, seed 1: none
    assert f"{past.mean:.3f}" == "0.125" and f"{all_4x.mean:.3f}" == "0.417"
    assert row.split(" | ")[4:6] == [str(all_4x), str(past)]
    only_the_end = {"short_16": {0: {**results["short_16"][0], "evaluation": repro.evaluation([1, 4], [1.0], 2)}}}
    assert "depth < 100 %" not in repro.summarise(only_the_end, [1, 4], niah=False, past_window=True)[0]
    bam_head = repro.summarise(results, [1, 4], niah=False)[0]
    assert bam_head == "| arm | seeds | prompts | passkey 1× | passkey 4× | val loss |"


def test_a_swax_result_without_per_depth_counts_is_scored_again():
    evaluation = repro.evaluation([1, 4], [0.0, 1.0], 4)
    old = {"evaluation": evaluation, "passkey": {"1": 1.0, "4": 0.5}}
    new = {**old, "passkey_by_depth": {"1": [4, 4], "4": [0, 4]}}
    swax, bam = repro.STUDIES["swax"], repro.STUDIES["bam"]
    assert not repro.reusable(old, swax, [1, 4], [0.0, 1.0], 4)
    assert repro.reusable(new, swax, [1, 4], [0.0, 1.0], 4)
    assert repro.reusable(old, bam, [1, 4], [0.0, 1.0], 4)  # its table does not need them
    assert not repro.reusable(new, swax, [1, 4], [0.0, 1.0], 2) and not repro.reusable(None, bam, [1], [1.0], 4)
