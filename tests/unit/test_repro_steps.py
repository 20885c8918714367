"""How many steps `megabam repro` trains each run for: the study's default, a train.steps override,
or --steps, in that order of precedence."""

import pytest

import megabam.eval.repro as repro
from megabam.cli import main


@pytest.mark.parametrize(
    ("study", "extra", "steps"),
    [
        ("bam", [], 1200),  # the study's default (twice the main job's 600)
        ("bam", ["train.steps=900"], 900),  # an override wins over the study's default
        ("bam", ["train.steps=900", "--steps", "50"], 50),  # --steps wins over both
        ("swax", [], 400),  # no study default: yaml_configs/swax_tiny_cpu.yaml's train.steps
    ],
)
def test_steps_per_run(monkeypatch, tmp_path, study, extra, steps):
    seen = {}

    def record(name, out, arms, seeds, multiples, depths, trials, overrides, steps, say):
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
