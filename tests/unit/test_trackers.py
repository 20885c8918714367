"""The trackers with the real libraries, offline: TensorBoard events read back with TensorBoard's own
reader, and wandb's entity, group, tags, name and resume id in an offline run (the trainer's path is
tests/e2e/test_train.py's test_tensorboard_events)."""

import struct
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from megabam.config import load_config
from megabam.config.loader import ConfigError
from megabam.train.compatibility import config_changes
from megabam.train.logger import RunLogger


def run_logger(tmp_path, *overrides, start_step=0, wandb_id=None) -> RunLogger:
    cfg = load_config(None, ["logging.progress_bar=false", "logging.wandb_mode=disabled", *overrides])
    return RunLogger(cfg, tmp_path, start_step, wandb_id, enabled=True)


def events(log_dir) -> EventAccumulator:
    return EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0}).Reload()


def test_tensorboard_resume_hides_steps_after_checkpoint(tmp_path):
    heads = {f"bam/layer{layer}/head{h}/theta_alpha": 0.1 * h for layer in (0, 1) for h in (0, 1)}
    first = run_logger(tmp_path, "logging.tensorboard=true")
    for step in (1, 2, 3, 4):  # killed after step 4, its checkpoint at step 2
        first.log(step, {"loss": float(step), **heads, "ssmax/layer0/head0/s": 1.0})
    first.close()
    resumed = run_logger(tmp_path, "logging.tensorboard=true", start_step=2)
    for step in (3, 4):
        resumed.log(step, {"loss": 10.0 * step})
    Image.new("RGB", (40, 30), "red").save(tmp_path / "loss.png")
    resumed.image("loss", tmp_path / "loss.png", 4)
    resumed.close()

    acc = events(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert [e.value for e in acc.Scalars("bam/layer1/head1/theta_alpha")] == pytest.approx([0.1, 0.1])
    [picture] = acc.Images("loss")
    assert (picture.step, picture.width, picture.height) == (4, 40, 30)
    # The heads of a layer share a chart, a category per quantity.
    config = acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    layout = layout_pb2.Layout.FromString(config)
    charts = {c.title: [(ch.title, list(ch.multiline.tag)) for ch in c.chart] for c in layout.category}
    assert charts == {
        "bam theta_alpha": [
            ("layer0", [r"^bam/layer0/head\d+/theta_alpha$"]),
            ("layer1", [r"^bam/layer1/head\d+/theta_alpha$"]),
        ],
        "ssmax s": [("layer0", [r"^ssmax/layer0/head\d+/s$"])],
    }


def test_tensorboard_off_writes_nothing(tmp_path):
    logger = run_logger(tmp_path)
    logger.log(1, {"loss": 1.0})
    logger.image("loss", tmp_path / "absent.png", 1)  # not read: no tracker takes images
    logger.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file: LevelDB's log format (32 KiB blocks; each fragment a
    7-byte header: crc, length, kind) after a 7-byte file header. Read here: wandb 0.31 ships no reader."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, pos, records, parts = path.read_bytes(), 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last fragment of one
            record = Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def test_wandb_entity_group_tags_name_and_resume_offline(tmp_path):
    wandb_keys = [
        "logging.wandb_mode=offline",
        "logging.wandb_entity=megabam-entity",
        "logging.wandb_group=megabam-group",
        "logging.wandb_tags=[bam-tag, ssmax-tag]",
    ]
    first = run_logger(tmp_path, *wandb_keys, "logging.wandb_name=megabam-name")
    run = first.wandb_run
    assert (run.entity, run.group, run.tags, run.name) == (
        "megabam-entity",
        "megabam-group",
        ("bam-tag", "ssmax-tag"),
        "megabam-name",
    )
    first.close()
    # What `wandb sync` uploads: the run record in the offline run's file (written by wandb's service
    # process, so looked for until it is there).
    [record] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline, runs = time.monotonic() + 20, []
    while not runs and time.monotonic() < deadline:
        runs = [r.run for r in wandb_records(record) if r.WhichOneof("record_type") == "run"]
        time.sleep(0.1)
    assert [(r.entity, r.run_group, list(r.tags), r.display_name) for r in runs] == [
        ("megabam-entity", "megabam-group", ["bam-tag", "ssmax-tag"], "megabam-name")
    ], [r.WhichOneof("record_type") for r in wandb_records(record)]

    # A resumed run continues the checkpoint's wandb run; without wandb_name it is named after run.name.
    resumed = run_logger(tmp_path, *wandb_keys, "run.name=megabam-run", start_step=2, wandb_id=run.id)
    assert (resumed.wandb_id, resumed.wandb_run.name) == (run.id, "megabam-run")
    resumed.close()


def test_wandb_tags_are_checked_with_the_config():
    assert load_config(None, ["logging.wandb_tags=[a, b-c]"]).logging.wandb_tags == ["a", "b-c"]
    with pytest.raises(ConfigError, match=r"logging.wandb_tags\[1\]: must be 1 to 64 characters"):
        load_config(None, [f"logging.wandb_tags=[a, {'x' * 65}]"])
    with pytest.raises(ConfigError, match="logging.wandb_tags: expected a list"):
        load_config(None, ["logging.wandb_tags=a"])


def test_trackers_may_change_on_resume():
    saved = asdict(load_config(None))
    now = asdict(load_config(None, ["logging.tensorboard=true", "logging.wandb_group=g"]))
    assert config_changes(saved, now) == ([], ["logging.tensorboard: False → True", "logging.wandb_group: None → 'g'"])


def test_optimizer_kind_may_not_change_on_resume():
    saved = asdict(load_config(None))
    now = asdict(load_config(None, ["optim.kind=radam", "schedule.warmup_steps=0"]))
    assert config_changes(saved, now) == (["optim.kind: 'adamw' → 'radam'"], ["schedule.warmup_steps: 20 → 0"])
