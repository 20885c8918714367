"""The planner's calibrated estimate (megabam/plan/calibration.py): the roofline's work split by kind
against a hand count, the calibrated tokens/s against a hand computation from a hand-made table, the
benchmark's entry giving back the step it was measured on, the checks of a table naming file and key
(exit 2 through the command), and the shipped table holding no measurement."""

import dataclasses
import json
from pathlib import Path

import pytest

from megabam.cli import main
from megabam.config import load_config
from megabam.config.schema import MIXER_NAMES
from megabam.plan.calibration import KINDS, TABLE, Calibration, CalibrationError, load_table, measured_entry
from megabam.plan.counts import forward_flops_by_component, meta_model, window_draws
from megabam.plan.hardware import GPUS
from megabam.plan.planner import config_layout, estimate, kind_of

ROOT = Path(__file__).resolve().parents[2]
SWAX = ROOT / "yaml_configs" / "swax_tiny_cpu.yaml"
EFFICIENCY = {"attention": 0.5, "mlstm": 0.25, "matmul": 0.8, "elementwise": 0.6, "optimizer": 0.4}
ENTRY = {
    "measured": "2026-12-05 12:00 UTC",
    "commit": "abc1234",
    "device": "NVIDIA H100 80GB HBM3",
    "command": "python tools/bench_gpu_train.py --write-calibration t.json",
    "models": ["swax_1p4b_mlstm"],
    "efficiency": EFFICIENCY,
    "overhead": 0.1,
}


def write_table(path: Path, entries: dict) -> Path:
    path.write_text(json.dumps({"about": "hand-made", "gpus": entries}))
    return path


def test_the_roofline_work_by_kind_is_the_roofline_step_split():
    """FLOP kinds at the peak (SWA's mixing is attention, mLSTM's its cell, the rest matmuls), bytes at
    HBM bandwidth; together the roofline's compute and hbm times."""
    cfg = load_config(SWAX)
    model, layout, gpu = meta_model(cfg), config_layout(cfg, 1), GPUS["h100-80gb"]
    e = estimate(cfg, model, layout, gpu, 8)
    forward = forward_flops_by_component(model, cfg.data.seq_len, window_draws(cfg))
    seconds = cfg.train.micro_batch_size * cfg.data.seq_len / (gpu.peak_tflops * 1e12)
    swa = sum(v for k, v in forward.items() if k.startswith("swa."))
    mlstm = sum(v for k, v in forward.items() if k.startswith("mlstm."))
    assert e.work["attention"] == pytest.approx(3 * swa * seconds, rel=1e-12)
    assert e.work["mlstm"] == pytest.approx(3 * mlstm * seconds, rel=1e-12)
    assert e.work["matmul"] == pytest.approx(3 * (sum(forward.values()) - swa - mlstm) * seconds, rel=1e-12)
    flops = e.work["attention"] + e.work["mlstm"] + e.work["matmul"]
    assert flops == pytest.approx(e.times["compute"]) and e.work["elementwise"] + e.work["optimizer"] == e.times["hbm"]


def test_every_mixer_is_a_kind_the_table_can_hold():
    assert {kind_of(f"{name}.part") for name in MIXER_NAMES} | {kind_of("mlp")} <= set(KINDS)


def test_the_calibrated_estimate_equals_a_hand_computation_from_the_table(tmp_path):
    """Σ roofline_kind / efficiency_kind / (1 − overhead), stretched by the bubble, plus communication:
    on 2 GPUs as 2 pipeline stages (a bubble) of 2 micro-batches each, data parallelism 2 across the
    4 (communication)."""
    (cal,) = load_table(write_table(tmp_path / "t.json", {"h100-80gb": ENTRY}), GPUS).values()
    cfg = load_config(SWAX)
    layout = dataclasses.replace(config_layout(cfg, 4), pipeline=2, data=2, grad_accum=2)
    e = estimate(cfg, meta_model(cfg), layout, GPUS["h100-80gb"], 8, cal)
    busy = sum(e.work[k] / EFFICIENCY[k] for k in e.work) / (1 - 0.1)
    bubble = (2 + 2 - 1) / 2
    communication = e.times["pipeline_sends"] + e.times["data_parallel"]
    assert communication > 0
    tokens = cfg.train.micro_batch_size * 2 * cfg.data.seq_len * 2
    assert e.calibrated_tokens_per_s == pytest.approx(tokens / (busy * bubble + communication), rel=1e-12)
    assert e.calibrated_mfu == pytest.approx(e.mfu * e.calibrated_tokens_per_s / e.tokens_per_s, rel=1e-12)
    assert e.calibrated_tokens_per_s < e.tokens_per_s  # every efficiency below 1: below the roofline
    bam = load_config(ROOT / "yaml_configs" / "tiny_cpu.yaml")  # no mLSTM: its efficiency is not needed
    assert estimate(bam, meta_model(bam), config_layout(bam, 1), GPUS["h100-80gb"], 8, cal).calibrated_mfu
    no_mlstm = dataclasses.replace(cal, efficiency={k: v for k, v in EFFICIENCY.items() if k != "mlstm"})
    e = estimate(cfg, meta_model(cfg), config_layout(cfg, 1), GPUS["h100-80gb"], 8, no_mlstm)
    assert no_mlstm.missing(e.work) == ["mlstm"] and e.calibrated_tokens_per_s is None


def test_the_benchmarks_entry_gives_back_the_step_it_measured():
    run = {
        "model": "m",
        "step_s": 2.0,
        "roofline": {"attention": 0.1, "mlstm": 0.2, "matmul": 0.5, "elementwise": 0.1, "optimizer": 0.05},
        "profile": {"attention": 0.4, "mlstm": 0.5, "matmul": 0.6, "elementwise": 0.2, "optimizer": 0.1, "other": 0.1},
    }
    source = {k: ENTRY[k] for k in ("measured", "commit", "device", "command")}
    cal = Calibration("h100-80gb", **measured_entry([run], source))
    assert cal.efficiency["mlstm"] == pytest.approx(0.2 / 0.5) and cal.overhead == pytest.approx(0.2 / 2.0)
    assert cal.step_seconds(run["roofline"]) == pytest.approx(2.0)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"gpus": {"h900": ENTRY}}, "gpus.h900"),
        (
            {"gpus": {"h100-80gb": {**ENTRY, "efficiency": {**EFFICIENCY, "matmul": -1}}}},
            "gpus.h100-80gb.efficiency.matmul",
        ),
        ({"gpus": {"h100-80gb": {**ENTRY, "efficiency": {"softmax": 0.5}}}}, "gpus.h100-80gb.efficiency.softmax"),
        ({"gpus": {"h100-80gb": {**ENTRY, "overhead": 1.0}}}, "gpus.h100-80gb.overhead"),
        ({"gpus": {"h100-80gb": {k: v for k, v in ENTRY.items() if k != "commit"}}}, "gpus.h100-80gb.commit"),
        ({"gpus": []}, "gpus"),
    ],
)
def test_a_bad_table_is_named_by_file_and_key(tmp_path, change, key):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"about": "hand-made", **change}))
    with pytest.raises(CalibrationError) as e:
        load_table(path, GPUS)
    assert (e.value.source, e.value.key) == (str(path), key)


def test_the_plan_command_prints_both_estimates_and_exits_2_on_a_bad_table(tmp_path, capsys):
    cmd = ["plan", str(SWAX), "--gpu", "h100-80gb", "--nodes", "1", "--gpus-per-node", "1"]
    good = write_table(tmp_path / "good.json", {"h100-80gb": ENTRY})
    assert main([*cmd, "--calibration", str(good)]) == 0
    out = capsys.readouterr().out
    assert "predicted: " in out and "\ncalibrated: " in out and "tokens/s (calibrated)" in out
    assert "calibration: h100-80gb, NVIDIA H100 80GB HBM3, measured 2026-12-05 12:00 UTC at abc1234" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpus": {"h100-80gb": {**ENTRY, "overhead": "a lot"}}}))
    assert main([*cmd, "--calibration", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"megabam: error: {bad}: gpus.h100-80gb.overhead: ")


def test_the_shipped_table_holds_no_measurement_yet(capsys):
    """No GPU has run tools/bench_gpu_train.py: the plan says so rather than show figures."""
    assert load_table(TABLE, GPUS) == {}
    assert main(["plan", str(SWAX), "--gpu", "h200-141gb", "--nodes", "1", "--gpus-per-node", "1"]) == 0
    out = capsys.readouterr().out
    assert f"calibration: no calibration for h200-141gb in {TABLE} (it holds none: no GPU has run" in out
    assert "\ncalibrated: " not in out
