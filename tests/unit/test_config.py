"""Config loading: the shipped YAML files load, overrides apply, and bad input is refused with the key named."""

from pathlib import Path

import pytest
import yaml

from megabam.config import ConfigError, load_config, save_config

CONFIGS = sorted(Path(__file__).parents[2].joinpath("yaml_configs").glob("*.yaml"))
TINY = next(p for p in CONFIGS if p.name == "tiny_cpu.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    load_config(path)


def test_overrides_apply_with_yaml_types(tmp_path):
    cfg = load_config(
        TINY,
        [
            "optim.lr=1e-3",
            "model.attention.window=64",
            "logging.peak_tflops=null",
            "model.layer_pattern=[attention, attention]",
        ],
    )
    assert cfg.optim.lr == 1e-3
    assert cfg.model.attention.window == 64
    assert cfg.logging.peak_tflops is None
    assert cfg.model.layer_pattern == ["attention", "attention"]


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(TINY, ["train.steps=70"])
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


def _write(tmp_path, data: dict) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


BAD = [
    ({"model": {"n_heads": 3, "d_model": 128}}, "model.n_heads"),
    ({"model": {"d_modle": 128}}, "model.d_modle"),
    ({"modle": {}}, "modle"),
    ({"data": {"seq_len": 0}}, "data.seq_len"),
    ({"data": {"seq_len": "long"}}, "data.seq_len"),
    ({"model": {"attention": {"window": 4096}}, "data": {"seq_len": 256}}, "model.attention.window"),
    ({"model": {"attention": {"positional": "rotary"}}}, "model.attention.positional"),
    ({"model": {"layer_pattern": ["attention", "mamba"]}}, "model.layer_pattern[1]"),
    ({"model": {"n_layers": 3, "layer_pattern": ["attention", "attention"]}}, "model.n_layers"),
    ({"model": {"tie_embeddings": "yes"}}, "model.tie_embeddings"),
    ({"optim": {"lr": -1.0}}, "optim.lr"),
    ({"optim": {"betas": [0.9]}}, "optim.betas"),
    ({"schedule": {"warmup_steps": 500}, "train": {"steps": 100}}, "schedule.warmup_steps"),
    ({"parallel": {"zero_stage": 3}}, "parallel.zero_stage"),
    ({"parallel": {"tensor": 3}}, "parallel.tensor"),
    ({"train": {"precision": "fp8"}}, "train.precision"),
    ({"model": {"attention": {"bam": {"beta_range": [1.0, -1.0]}}}}, "model.attention.bam.beta_range"),
    ({"data": {"passkey_fraction": 1.5}}, "data.passkey_fraction"),
    ({"data": {"passkey_key_digits": [6, 4]}}, "data.passkey_key_digits"),
    ({"data": {"passkey_key_digits": [0, 5]}}, "data.passkey_key_digits"),
    ({"data": {"passkey_answer_end": "dot"}}, "data.passkey_answer_end"),
    ({"model": {"attention": {"positional": "rope"}, "d_model": 12, "n_heads": 4}}, "model.attention.positional"),
    ({"run": {"name": "a/b"}}, "run.name"),
    ({"model": {"n_heads": 4, "attention": {"kv_heads": 3}}}, "model.attention.kv_heads"),
    (
        {
            "model": {"n_heads": 4, "layer_pattern": ["attention"], "attention": {"kv_heads": 2}},
            "parallel": {"tensor": 4},
        },
        "parallel.tensor",
    ),
]


@pytest.mark.parametrize("data,key", BAD, ids=[k for _, k in BAD])
def test_bad_config_names_key_and_file(tmp_path, data, key):
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert err.value.key == key
    assert message.startswith(f"{path}: {key}: ")
    assert "\n" not in message


def test_bad_override_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"optim\.lrr: unknown key"):
        load_config(TINY, ["optim.lrr=1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(TINY, ["optim.lr"])


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\xff\xfe\x00binary", "not a UTF-8 text file (byte 0 is 0xff)"),
        (b"", "is empty"),
        (b"# a comment only\n\n", "is empty"),
        (b"run:\n  name: a\nrun:\n  name: b\n", "line 3, column 1: key 'run' given twice (first on line 1)"),
        (b"train:\n  steps: 3\n  steps: 4\n", "key 'steps' given twice"),
        (b"run:\n  name: [a\n", "not valid YAML (line 3, column 1: expected ',' or ']'"),
    ],
    ids=["binary", "empty", "comment-only", "duplicate-section", "duplicate-key", "syntax"],
)
def test_unusable_config_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: <file>: ") and message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lr=.nan", "optim.lr"),
        ("optim.lr=.inf", "optim.lr"),
        ("optim.lr=0", "optim.lr"),
        ("optim.grad_clip=.nan", "optim.grad_clip"),
        ("optim.eps=0", "optim.eps"),
        ("model.init_std=-0.02", "model.init_std"),
        ("model.norm_eps=0", "model.norm_eps"),
        ("model.attention.rope_theta=-1", "model.attention.rope_theta"),
        ("model.swa.rope_theta=.inf", "model.swa.rope_theta"),
        ("run.name=.", "run.name"),
        ("run.name=..", "run.name"),
        ("run.name=a/b", "run.name"),
        ("model.attention.ssmax_init=.nan", "model.attention.ssmax_init"),
        ("model.attention.ssmax_init=.inf", "model.attention.ssmax_init"),
        ("model.swa.ssmax_init=0", "model.swa.ssmax_init"),
        ('run.name="a\\nb"', "run.name"),
        ('run.name="a\\0b"', "run.name"),
        ("run.name=" + "x" * 241, "run.name"),
        ("run.seed=-1", "run.seed"),
        ("run.seed=100000000000000000000", "run.seed"),
        ("data.seq_len=1000000000", "data.seq_len"),
        ("model.vocab_size=2000000000", "model.vocab_size"),
    ],
)
def test_non_finite_non_positive_and_path_like_values_are_refused(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.key == key


@pytest.mark.parametrize(
    "override, key",
    [("window.probabilities=[0.3]", "window.probabilities"), ("window.anneal_fraction=2", "window.anneal_fraction")],
)
def test_window_section_is_checked_without_sliding_window_layers(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.layer_pattern=[attention]", override])
    assert err.value.key == key
