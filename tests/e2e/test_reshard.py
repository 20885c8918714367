"""`megabam convert reshard` on checkpoints that real parallel training wrote (DeepSpeed under torchrun,
gloo): TP=2 (ZeRO-1; BAM attention with grouped kv heads, then mLSTM) → TP=1 × PP=2, and DP=2 (ZeRO-2)
→ DP=1 (ZeRO-1). The resharded run resumed at the new
layout must give the losses of the original run continuing at its own, and (TP=2 → TP=1 × PP=2, the
case that splits and regroups every tensor) the optimizer state that DeepSpeed loads from the new
checkpoint must be the original's re-split (tests/helpers/optimizer_dump.py: both sides read by
DeepSpeed itself, gathered over data-parallel ranks by its own API). DP=2 → DP=1 rests on the losses:
its moments only change partitioning, and moments left at zero are 6e-3 off where it asks for 1e-6
(two DeepSpeed launches, ~12 s of the suite, spared)."""

import hashlib
import subprocess
import sys

import pytest
import torch
from helpers.runs import ENV, REPO, losses, megabam_train

from megabam.checkpoint.reader import CheckpointReader
from megabam.cli import main
from megabam.parallel.tensor_parallel import unshard

# Measured: 1.2e-7 (TP=2 → TP=1 × PP=2) and 6.3e-8 (DP=2 → DP=1) relative, over steps 4-6; the same
# resume with the Adam moments left at zero is 6e-3 off at step 5.
LOSS_RTOL = 1e-6

# name → (source overrides, reshard flags, processes after, whether the optimizer state is compared)
CASES = {
    # BAM attention (per-head θ, SSMax s) with 2 of 4 kv heads, then an mLSTM layer (per-head gates, head norm)
    "tp2_to_tp1pp2": (
        ["parallel.tensor=2", "parallel.zero_stage=1", "model.layer_pattern=[AM]", "model.attention.kv_heads=2"],
        ["--tp", "1", "--pp", "2"],
        2,
        True,
    ),
    "dp2_to_dp1": (["parallel.zero_stage=2"], ["--tp", "1", "--pp", "1", "--dp", "1", "--zero-stage", "1"], 1, False),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, data_cache):
    """Each case's original run (6 steps, checkpoints at 3 and 6), trained once for the module."""
    root, made = tmp_path_factory.mktemp("reshard"), {}

    def source(case: str):
        if case not in made:
            overrides = ["train.steps=6", "checkpoint.every=3", "checkpoint.keep=2", *CASES[case][0]]
            megabam_train(root, data_cache, f"run.name={case}", *overrides, nproc=2)
            made[case] = root / case
        return made[case]

    return source


def dump_optimizers(checkpoints: dict, nproc: int) -> list[dict]:
    """Each checkpoint's optimizer state as DeepSpeed loads it (checkpoint → file to write), in one
    launch of `nproc` ranks."""
    helper = REPO / "tests" / "helpers" / "optimizer_dump.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(helper)]
    cmd += [str(path) for pair in checkpoints.items() for path in pair]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return [torch.load(out, weights_only=True) for out in checkpoints.values()]


def full_states(dump: dict, reader: CheckpointReader) -> dict[str, dict[str, torch.Tensor]]:
    """Per Decoder parameter, its master weights and moments put together from the tensor ranks."""
    out = {}
    for name in {key.rsplit("@", 1)[0] for key in dump["params"]}:
        split, ranks = reader.splits.get(name), range(reader.tp)
        pieces = [dump["params"][f"{name}@{r}"] for r in ranks]
        out[name] = {
            kind: pieces[0][kind] if split is None else unshard([p[kind] for p in pieces], split.dim, split.parts)
            for kind in pieces[0]
        }
    return out


def digests(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("case", CASES)
def test_a_resharded_run_resumes_as_the_original_continues(tmp_path, data_cache, sources, case, capsys):
    source = sources(case)
    ckpt = source / "checkpoints" / "step_00000003"
    before = digests(ckpt)
    out = tmp_path / "resharded"
    assert main(["convert", "reshard", str(ckpt), str(out), *CASES[case][1]]) == 0
    report, err = capsys.readouterr()
    assert "Adam moments and step 3" in report
    assert f"reshard: building data 1 × pipeline {CASES[case][1][3]} × tensor 1 on " in err, err  # progress note
    assert digests(ckpt) == before

    nproc, compare_optimizer = CASES[case][2:]
    megabam_train(tmp_path, data_cache, "run.name=resharded", nproc=nproc, config=out / "config.yaml")
    original, resumed = losses(source), losses(out)
    assert sorted(resumed) == list(range(1, 7))  # the source's metrics up to the checkpoint, then its own
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(original[step], rel=LOSS_RTOL), step
    if not compare_optimizer:
        return

    assert nproc == 2  # the source's world size too: both load in one launch
    theirs, ours = dump_optimizers(
        {ckpt: tmp_path / "source.pt", out / "checkpoints" / "step_00000003": tmp_path / "resharded.pt"}, nproc
    )
    assert theirs["steps"] == ours["steps"] == [3]
    expected, got = full_states(theirs, CheckpointReader(ckpt)), full_states(ours, CheckpointReader(out))
    assert sorted(expected) == sorted(got) and len(expected) > 10
    for name, state in expected.items():
        for kind, tensor in state.items():
            assert torch.equal(got[name][kind], tensor), (name, kind)


def test_reshard_refuses_bad_input_in_one_line_before_writing(tmp_path, sources, capsys):
    source = sources("dp2_to_dp1")
    ckpt = source / "checkpoints" / "step_00000003"
    before = digests(ckpt)
    out = tmp_path / "out"
    bad = {
        "parallel.tensor": ["--tp", "3", "--pp", "1"],  # 3 does not divide the heads
        "--dp": ["--tp", "1", "--pp", "1", "--dp", "4"],  # 2 micro-batches a step do not split over 4 ranks
        "--pp": ["--tp", "1", "--pp", "0"],
        "parallel.zero_stage": ["--tp", "1", "--pp", "2"],  # ZeRO-2 with a pipeline
    }
    for key, flags in bad.items():
        assert main(["convert", "reshard", str(ckpt), str(out), *flags]) == 2, key
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and key in err, err
        assert not out.exists()

    out.mkdir()
    assert main(["convert", "reshard", str(ckpt), str(out), "--tp", "1", "--pp", "1"]) == 2
    assert "already exists" in capsys.readouterr().err

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ckpt.iterdir():
        if f.is_file():
            (broken / f.name).write_bytes(f.read_bytes())
    missing = broken / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    manifest = (broken / "manifest.json").read_text()
    missing.unlink()
    (broken / "manifest.json").write_text(manifest)
    assert main(["convert", "reshard", str(broken), str(tmp_path / "o2"), "--tp", "1", "--pp", "1"]) == 2
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in capsys.readouterr().err
    assert digests(ckpt) == before and not (tmp_path / "o2").exists()
