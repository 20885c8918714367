"""The checkpoint metadata (megabam.json) as a typed, versioned record: written, read back equal, and
every malformed file refused in one line that names it."""

import dataclasses
import json

import pytest

from megabam.checkpoint.store import META_VERSION, CheckpointError, CheckpointMeta
from megabam.config import load_config


def meta() -> CheckpointMeta:
    return CheckpointMeta(
        step=40,
        tokens=81920,
        samples=320,
        loader={"epoch": 0, "sample_in_epoch": 320},
        config=dataclasses.asdict(load_config(None)),
        skipped_steps=1,
        tokenizer="runs/x/tokenizer.model",
        wandb_id=None,
        window_sampler=None,
    )


def test_round_trip_keeps_every_field(tmp_path):
    path = tmp_path / "megabam.json"
    path.write_text(meta().to_json())
    assert json.loads(path.read_text())["version"] == META_VERSION
    assert CheckpointMeta.read(path) == meta()


def test_a_checkpoint_written_before_versioning_still_loads(tmp_path):
    """Files written before the version field existed hold exactly these fields, without it."""
    old = dataclasses.asdict(meta())
    del old["version"]
    path = tmp_path / "megabam.json"
    path.write_text(json.dumps(old))
    assert CheckpointMeta.read(path) == meta()


def _write(tmp_path, change) -> str:
    raw = dataclasses.asdict(meta())
    change(raw)
    path = tmp_path / "megabam.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as failure:
        CheckpointMeta.read(path)
    message = str(failure.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message


def test_newer_version_is_refused(tmp_path):
    message = _write(tmp_path, lambda raw: raw.update(version=META_VERSION + 1))
    assert f"metadata version {META_VERSION + 1}" in message and "upgrade megabam" in message


def test_unknown_field_is_refused(tmp_path):
    assert "unknown field(s) extra" in _write(tmp_path, lambda raw: raw.update(extra=1))


def test_missing_field_is_refused(tmp_path):
    assert "missing field(s) loader" in _write(tmp_path, lambda raw: raw.pop("loader"))


@pytest.mark.parametrize(
    "field, value, expected",
    [("step", "40", "int"), ("step", True, "int"), ("wandb_id", 3, "str or null"), ("loader", [], "dict")],
)
def test_wrong_type_is_refused(tmp_path, field, value, expected):
    assert f"field {field} must be {expected}" in _write(tmp_path, lambda raw: raw.update({field: value}))


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", ""])
def test_not_an_object_is_refused(tmp_path, text):
    path = tmp_path / "megabam.json"
    path.write_text(text)
    with pytest.raises(CheckpointError, match=str(path)):
        CheckpointMeta.read(path)
