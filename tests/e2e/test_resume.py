"""Issue "Resumable pretraining": kill -9 and SIGTERM mid-run, corrupted checkpoints, NaN steps and
config changes — the resumed run must repeat the uninterrupted run's losses exactly."""

import json
import os
import random
import shutil
import signal

import psutil
import pytest
import torch
import xxhash
from helpers.runs import is_rank, losses, megabam_train, start_train, wait_for_step
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

STEPS = 14
RUN = [
    f"train.steps={STEPS}",
    "checkpoint.every=2",
    "checkpoint.keep=2",
    "eval.passkey_samples=0",
    "train.eval_every=0",
]


def test_kill9_then_auto_resume_repeats_the_losses(tmp_path, data_cache):
    """Two kills of the whole job, two ranks, in fp32. (A bf16 resume repeats its losses bit for bit
    too: test_train.py's resume under ZeRO-2 with accumulation; a kill only changes which checkpoint
    the resume starts from, which this tests.)"""
    kills = 2
    megabam_train(tmp_path, data_cache, "run.name=reference", *RUN, nproc=2)
    run_dir, log = tmp_path / "killed", tmp_path / "killed.log"
    kill_steps = sorted(random.Random(7).sample(range(2, STEPS - 1), kills))
    for step in kill_steps:
        proc = start_train(tmp_path, data_cache, "run.name=killed", *RUN, nproc=2, log=log)
        wait_for_step(run_dir, step, proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # the same command again resumes by itself, from the newest complete checkpoint
    megabam_train(tmp_path, data_cache, "run.name=killed", *RUN, nproc=2)
    reference, resumed = losses(tmp_path / "reference"), losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):  # bit for bit
        assert resumed[step] == reference[step], (step, kill_steps)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000012", "step_00000014"]


def test_sigterm_checkpoints_and_exits_75_then_resumes_exactly(tmp_path, data_cache):
    megabam_train(tmp_path, data_cache, "run.name=reference", *RUN)
    run_dir = tmp_path / "signalled"
    # the wandb run continues under its id; TensorBoard shows each step once
    trackers = ["logging.wandb_mode=offline", "logging.tensorboard=true"]
    proc = start_train(tmp_path, data_cache, "run.name=signalled", *RUN, *trackers, log=tmp_path / "signalled.log")
    wait_for_step(run_dir, 5, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 75
    stopped_at = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 5 <= stopped_at < STEPS
    assert "preempted after step" in (tmp_path / "signalled.log").read_text()
    megabam_train(tmp_path, data_cache, "run.name=signalled", *RUN, *trackers)
    assert losses(run_dir) == losses(tmp_path / "reference")
    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and len({p.name.rsplit("-", 1)[1] for p in wandb_runs}) == 1, wandb_runs
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload().Scalars("loss")
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert len(events) == STEPS and {e.step: e.value for e in events} == pytest.approx(losses(run_dir))


@pytest.mark.parametrize("layout", [[], ["parallel.pipeline=2"]], ids=["data_parallel", "pipeline"])
def test_sigusr1_on_one_rank_stops_every_rank_after_the_same_step(tmp_path, data_cache, layout):
    run_dir = tmp_path / "usr1"
    proc = start_train(tmp_path, data_cache, "run.name=usr1", *RUN, *layout, nproc=2, log=tmp_path / "usr1.log")
    wait_for_step(run_dir, 3, proc)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if is_rank(" ".join(p.cmdline()))]
    assert len(workers) == 2
    workers[0].send_signal(signal.SIGUSR1)  # as SLURM's --signal does, but to one rank only
    assert proc.wait(timeout=120) == 75  # the launch script passes the ranks' code on
    text = (tmp_path / "usr1.log").read_text()
    assert text.count("preempted after step") >= 1
    tag = (run_dir / "checkpoints" / "latest").read_text().strip()
    # both ranks' state went into that checkpoint: their RNG files and optimizer shards (ZeRO's, or
    # each pipeline stage's)
    assert sorted(p.name for p in (run_dir / "checkpoints" / tag).glob("rng_rank*.json")) == [
        "rng_rank00000.json",
        "rng_rank00001.json",
    ]
    assert len(list((run_dir / "checkpoints" / tag).glob("*optim_states.pt"))) == 2


class NotATensor:
    """Any object but tensors and plain data: what a crafted checkpoint file might hold."""


EVERY_STEP = ["checkpoint.every=1", "checkpoint.keep=9", "eval.passkey_samples=0", "train.eval_every=0"]


@pytest.fixture(scope="module")
def every_step(tmp_path_factory, data_cache):
    """A run of 7 steps with a checkpoint at every step, all kept; tests damage or change copies of it."""
    root = tmp_path_factory.mktemp("every_step")
    megabam_train(root, data_cache, "run.name=run", "train.steps=7", *EVERY_STEP)
    return root / "run"


def damage(ckpt, kind: str) -> None:
    """Damage checkpoint folder `ckpt` as a disk, an interrupted copy or a crafted file would."""
    if kind == "truncate":
        shard = next(ckpt.glob("*optim_states.pt"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif kind in ("non-tensor-pickle", "garbled-meta"):  # crafted, with a manifest to match
        if kind == "non-tensor-pickle":  # a pickle weights_only refuses
            changed = next(ckpt.glob("*model_states.pt"))
            torch.save({"module": NotATensor()}, changed)
        else:  # metadata that is no JSON
            changed = ckpt / "megabam.json"
            changed.write_bytes(b"\x00{ not json")
        manifest = json.loads((ckpt / "manifest.json").read_text())
        digest = xxhash.xxh3_128(changed.read_bytes()).hexdigest()
        manifest["files"][changed.name] = {"bytes": changed.stat().st_size, "xxh3_128": digest}
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
    elif kind == "no-manifest":
        (ckpt / "manifest.json").unlink()
    else:  # valid JSON of the wrong shape
        (ckpt / "manifest.json").write_text('{"files": {}}' if kind == "manifest-without-files" else "[1, 2]")


# Newest first: the resume meets each damage in turn, those the manifest shows (verified before
# anything loads) and those only loading shows (metadata, then DeepSpeed's files), in one start.
DAMAGES = ["non-tensor-pickle", "garbled-meta", "truncate", "no-manifest", "manifest-without-files", "manifest-a-list"]


def test_damaged_checkpoints_are_set_aside_back_to_the_newest_usable_one(tmp_path, data_cache, every_step):
    run = tmp_path / "damaged"
    shutil.copytree(every_step, run)
    checkpoints = run / "checkpoints"
    for step, kind in zip(range(7, 1, -1), DAMAGES):
        damage(checkpoints / f"step_{step:08d}", kind)
    result = megabam_train(tmp_path, data_cache, "run.name=damaged", "train.steps=9", *EVERY_STEP)
    out = result.stdout + result.stderr
    for step, kind in zip(range(7, 1, -1), DAMAGES):
        tag = f"step_{step:08d}"
        assert f"checkpoint {checkpoints / tag} is unusable" in out and f"set aside as .unusable-{tag}" in out, kind
        assert (checkpoints / f".unusable-{tag}").is_dir(), kind  # kept, not deleted
    assert "resumed from" in out and "step_00000001 at step 1" in out
    assert "accepted config change train.steps: 7 → 9" in out
    assert sorted(losses(run)) == list(range(1, 10))
    assert (checkpoints / "latest").read_text().strip() == "step_00000009"


@pytest.mark.parametrize("layout", [[], ["parallel.pipeline=2"]], ids=["data_parallel", "pipeline"])
def test_nan_step_is_skipped_on_both_ranks_and_training_continues(tmp_path, data_cache, layout):
    """Two data-parallel ranks, or two pipeline stages (the engine's train_batch path: the poisoned
    activations make the last stage's loss and every stage's gradients non-finite, and both skip the
    update). The NaN comes from a hook the test installs (tests/helpers/inject_nan.py)."""
    result = megabam_train(
        tmp_path, data_cache, "run.name=nan", *RUN[1:], "train.steps=6", *layout, nproc=2, nan_steps=[3]
    )
    out = result.stdout + result.stderr
    assert "step 3: non-finite loss or gradient norm, update skipped (1 in a row)" in out
    assert "skipped (non-finite) 1" in out
    curve = losses(tmp_path / "nan")
    assert sorted(curve) == [1, 2, 4, 5, 6] and all(v == v for v in curve.values())  # finite after the skip


def test_consecutive_nan_steps_stop_the_run_naming_the_last_good_checkpoint(tmp_path, data_cache):
    result = megabam_train(
        tmp_path,
        data_cache,
        "run.name=nans",
        *RUN[1:],
        "train.steps=8",
        "checkpoint.every=1",
        "train.max_bad_steps=3",
        check=False,
        nan_steps=[3, 4, 5],
    )
    assert result.returncode == 3
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("megabam: error: 3 consecutive steps") and last.endswith("step_00000002")


def test_incompatible_config_change_is_refused_with_the_keys(tmp_path, data_cache, every_step):
    shutil.copytree(every_step, tmp_path / "shape")
    before = sorted(p.name for p in (tmp_path / "shape" / "checkpoints").iterdir())
    result = megabam_train(
        tmp_path,
        data_cache,
        "run.name=shape",
        "train.steps=7",
        *EVERY_STEP,
        "model.n_layers=3",
        "train.micro_batch_size=2",
        check=False,
    )
    assert result.returncode == 2
    message = result.stderr.strip().splitlines()[-1]
    assert "model.n_layers: 2 → 3" in message and "train.micro_batch_size: 4 → 2" in message
    assert sorted(p.name for p in (tmp_path / "shape" / "checkpoints").iterdir()) == before
