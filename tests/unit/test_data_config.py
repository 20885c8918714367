"""The data section of the config: mixtures of prepared datasets, checked before training."""

import random

import pytest

from megabam.config import ConfigError, load_config
from megabam.data.corpus import python_stdlib_documents
from megabam.data.prepare import prepare_dataset
from megabam.data.tokenizer import train_tokenizer
from megabam.data.training_data import build_training_data

MDS = ["data.source=mds", "data.tokenizer=tok.model"]


@pytest.mark.parametrize(
    "overrides, key, message",
    [
        (["data.source=mds"], "data.streams", "at least one stream"),
        (["data.source=mds", "data.streams=[{path: a}]"], "data.tokenizer", "tokenizer"),
        (MDS + ["data.streams=[{path: a, weight: 1}, {path: b, weight: 0}]"], "data.streams[1].weight", "positive"),
        (MDS + ["data.streams=[{path: a, weight: 1}, {path: b, weight: -2}]"], "data.streams[1].weight", "positive"),
        (MDS + ["data.streams=[{path: a, weight: 1}, {path: b}]"], "data.streams[1].weight", "every stream"),
        (MDS + ["data.streams=[{path: a, repeat: 0}]"], "data.streams[0].repeat", "positive"),
        (MDS + ["data.streams=[{path: a, weight: 1, repeat: 2}]"], "data.streams[0]", "not both"),
        (MDS + ["data.streams=[{path: ''}]"], "data.streams[0].path", "dataset directory"),
        (MDS + ["data.streams=[{path: a, wieght: 1}]"], "data.streams[0].wieght", "unknown key"),
        (["data.streams=[{path: a}]"], "data.streams", "only used with data.source: mds"),
    ],
)
def test_stream_config_errors_name_the_key(overrides, key, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert info.value.key == key and message in str(info.value)


def test_mixture_config_is_accepted():
    cfg = load_config(None, MDS + ["data.streams=[{path: a, weight: 3}, {path: b, remote: 's3://x/b', weight: 1}]"])
    assert [(s.path, s.remote, s.weight) for s in cfg.data.streams] == [("a", None, 3.0), ("b", "s3://x/b", 1.0)]


def test_trainer_refuses_a_tokenizer_of_another_vocab_size(tmp_path):
    tok = tmp_path / "tok.model"
    train_tokenizer(python_stdlib_documents(200_000), tok, vocab_size=400)
    rng = random.Random(0)
    (tmp_path / "in.txt").write_text(
        "\n".join(" ".join(rng.choice(["a", "bb", "ccc"]) for _ in range(50)) for _ in range(200))
    )
    prepare_dataset([str(tmp_path / "in.txt")], tmp_path / "ds", tok, 31, text_unit="line", workers=0, val_fraction=0.1)
    overrides = [
        "data.source=mds",
        f"data.tokenizer={tok}",
        f"data.streams=[{{path: {tmp_path / 'ds'}}}]",
        "data.seq_len=31",
    ]
    with pytest.raises(ConfigError, match="model.vocab_size: 4096, but the tokenizer has 400 pieces"):
        build_training_data(load_config(None, overrides), rank=0)
    data = build_training_data(load_config(None, overrides + ["model.vocab_size=400"]), rank=0)
    assert data.tokenizer_path == tok and [s.split for s in data.train + data.val] == ["train", "val"]


def test_trainer_refuses_a_bit_flipped_local_shard_when_asked_to_hash(tmp_path):
    tok = tmp_path / "tok.model"
    train_tokenizer(python_stdlib_documents(200_000), tok, vocab_size=400)
    (tmp_path / "in.txt").write_text("\n".join(f"line {i} of some text" for i in range(400)))
    prepare_dataset([str(tmp_path / "in.txt")], tmp_path / "ds", tok, 31, text_unit="line", workers=0, val_fraction=0.1)
    shard = sorted((tmp_path / "ds" / "train").rglob("shard.*"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    shard.write_bytes(bytes(data))
    overrides = [
        "data.source=mds",
        f"data.tokenizer={tok}",
        f"data.streams=[{{path: {tmp_path / 'ds'}}}]",
        "data.seq_len=31",
        "model.vocab_size=400",
    ]
    build_training_data(load_config(None, overrides), rank=0)  # sizes match: only hashing can tell
    with pytest.raises(ConfigError, match="sha1"):
        build_training_data(load_config(None, overrides + ["data.verify_hashes=true"]), rank=0)
