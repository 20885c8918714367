"""The command line as a researcher types it: options and overrides in any order on every command,
`train --print-config` / `--dry-run`, configs built from others (`defaults:`), `megabam config diff`,
and the command-line form of every list-valued key."""

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from megabam.cli import build_parser, main
from megabam.config import ConfigError, load_config
from megabam.config.loader import config_to_dict
from megabam.model import Decoder
from megabam.train.cli import describe_config

ROOT = Path(__file__).resolve().parents[2]
CFG = str(ROOT / "yaml_configs" / "tiny_cpu.yaml")

# (options last: what argparse always took, the same words with options in between: refused before)
ORDERS = {
    "train": (
        ["train", CFG, "optim.lr=1e-3", "train.steps=70", "--fresh"],
        ["train", CFG, "optim.lr=1e-3", "--fresh", "train.steps=70"],
    ),
    "launch": (
        ["launch", "local", CFG, "optim.lr=1e-3", "train.steps=70", "--gpus-per-node", "2"],
        ["launch", "local", CFG, "optim.lr=1e-3", "--gpus-per-node", "2", "train.steps=70"],
    ),
    "plan": (
        ["plan", CFG, "optim.lr=1e-3", "model.n_layers=8", "--gpu", "h100-80gb"],
        ["plan", CFG, "optim.lr=1e-3", "--gpu", "h100-80gb", "model.n_layers=8"],
    ),
    "repro": (
        ["repro", "bam", "train.steps=5", "optim.lr=1e-3", "--out", "x"],
        ["repro", "bam", "train.steps=5", "--out", "x", "optim.lr=1e-3"],
    ),
    "data prepare": (
        ["data", "prepare", "a.txt", "b.txt", "--out", "o", "--tokenizer", "t.model", "--seq-len", "64"],
        ["data", "prepare", "a.txt", "--out", "o", "--tokenizer", "t.model", "b.txt", "--seq-len", "64"],
    ),
    "data tokenizer": (
        ["data", "tokenizer", "a.txt", "b.txt", "--out", "t.model", "--vocab-size", "512"],
        ["data", "tokenizer", "a.txt", "--out", "t.model", "b.txt", "--vocab-size", "512"],
    ),
}


@pytest.mark.parametrize("command", ORDERS)
def test_options_and_overrides_parse_in_any_order(command):
    usual, mixed = ORDERS[command]
    assert vars(build_parser().parse_args(mixed)) == vars(build_parser().parse_args(usual))


def test_print_config_shows_the_resolved_config_and_what_the_overrides_changed(capsys):
    assert main(["train", CFG, "optim.lr=1e-3", "--print-config", "train.steps=70"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == [
        "# optim.lr: 0.003 → 0.001 (command line)",
        "# train.steps: 600 → 70 (command line)",
    ]
    assert yaml.safe_load(out) == config_to_dict(load_config(CFG, ["optim.lr=1e-3", "train.steps=70"]))


def test_dry_run_builds_the_model_on_meta_and_writes_nothing(tmp_path, capsys):
    out_dir = tmp_path / "runs"
    assert main(["train", "--dry-run", CFG, f"run.output_dir={out_dir}", "parallel.tensor=2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    cfg = load_config(CFG, [f"run.output_dir={out_dir}", "parallel.tensor=2"])
    with torch.device("meta"):
        n = sum(p.numel() for p in Decoder(cfg.model).parameters())
    assert lines[1].startswith(f"model: {n:,} parameters (4 layers: attention ×4")
    assert any(line.startswith("layout: 2 rank(s) = TP2 PP1 DP1") for line in lines)
    assert any(line.startswith("memory per cpu device (planner): ") and "GiB" in line for line in lines)
    assert any(line.startswith("data: the embedded default corpus") for line in lines)
    assert lines[-1] == f"run directory: {out_dir / 'tiny_cpu'} (new)"
    assert not out_dir.exists()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_config_composes_its_defaults_later_files_and_overrides_winning(tmp_path):
    _write(tmp_path / "base.yaml", "model: {d_model: 64, n_layers: 2}\noptim: {lr: 0.01, weight_decay: 0.2}\n")
    _write(tmp_path / "long.yaml", "data: {seq_len: 128}\noptim: {lr: 0.02}\n")
    (tmp_path / "exp").mkdir()
    exp = _write(tmp_path / "exp" / "a.yaml", "defaults: [../base.yaml, ../long.yaml]\nmodel: {n_layers: 3}\n")
    cfg = load_config(exp, ["optim.weight_decay=0.05"])
    assert (cfg.model.d_model, cfg.model.n_layers) == (64, 3)  # the file over its bases, key by key
    assert (cfg.data.seq_len, cfg.optim.lr) == (128, 0.02)  # the later base over the earlier
    assert cfg.optim.weight_decay == 0.05  # the command line over all
    # A single base may be given as a string; the saved (resolved) config carries no defaults key.
    one = _write(tmp_path / "one.yaml", "defaults: base.yaml\n")
    assert load_config(one).model.d_model == 64
    assert "defaults" not in config_to_dict(cfg)


def test_bad_compositions_are_one_line_errors_naming_the_file(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    _write(a, "defaults: [b.yaml]\n")
    _write(b, "defaults: [a.yaml]\nmodel: {d_model: 64}\n")
    with pytest.raises(ConfigError, match=r"defaults: the files include each other \(.*a.yaml → .*b.yaml → .*a.yaml\)"):
        load_config(a)
    _write(b, "model: {d_model: 64}\noptim: {lr: -1}\n")
    with pytest.raises(ConfigError) as raised:  # a bad value a base file set: that file is named
        load_config(a)
    assert (raised.value.source, raised.value.key) == (str(b), "optim.lr")
    load_config(a, ["optim.lr=0.001"])  # ... and once the command line sets it, it is the command line's
    with pytest.raises(ConfigError) as raised:
        load_config(a, ["optim.lr=-2"])
    assert (raised.value.source, raised.value.key) == (str(a), "optim.lr")
    _write(a, "defaults: [missing.yaml]\n")
    with pytest.raises(ConfigError, match="defaults: missing.yaml is not a file"):
        load_config(a)
    _write(a, "defaults: {base: b.yaml}\n")
    with pytest.raises(ConfigError, match="defaults: expected a list of config files"):
        load_config(a)


def test_config_diff_names_each_differing_key(tmp_path, capsys):
    other = _write(tmp_path / "o.yaml", "defaults: [" + CFG + "]\noptim: {lr: 0.001}\ntrain: {steps: 70}\n")
    assert main(["config", "diff", CFG, str(other)]) == 1
    assert capsys.readouterr().out.splitlines() == ["optim.lr: 0.003 → 0.001", "train.steps: 600 → 70"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(load_config(CFG))))
    assert main(["config", "diff", str(run), CFG]) == 0
    assert "give the same config" in capsys.readouterr().out
    assert main(["config", "diff", str(tmp_path), CFG]) == 2
    assert "a directory without config.yaml" in capsys.readouterr().err


def test_help_config_shows_every_list_keys_command_line_form_and_that_form_parses():
    lines = {line.split()[0]: line for line in describe_config(type(load_config(None)))}
    lists = [
        (key, line)
        for key, line in lines.items()
        if "[]." not in key and isinstance(_default(key), list)  # each list-valued key itself
    ]
    assert lists and all("On the command line: " in line for _, line in lists), lists
    assert "data.streams='[{path: ..., remote: ...}, ...]'" in lines["data.streams"]
    assert "data.streams[].weight" in lines
    raw = {"data": {"source": "mds", "tokenizer": "t.model"}}
    cfg = load_config(_write_yaml(raw), ["data.streams=[{path: a, weight: 1}, {path: b, weight: 3}]"])
    assert [(s.path, s.weight) for s in cfg.data.streams] == [("a", 1.0), ("b", 3.0)]


def _default(key: str):
    node = load_config(None)
    for part in key.split("."):
        node = getattr(node, part)
    return node if not dataclasses.is_dataclass(node) else None


def _write_yaml(raw: dict) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path
