"""`megabam data tokenizer|prepare|inspect|synth`: inputs, packing, shards, summaries and bad input."""

import gzip
import json
import os
import random

import numpy as np
import pytest
import zstandard

from megabam.cli import main
from megabam.config.schema import StreamConfig
from megabam.data.corpus import python_stdlib_documents
from megabam.data.errors import DataError
from megabam.data.inspect_data import inspect_dataset
from megabam.data.mixture import StreamSpec, check_streams
from megabam.data.niah import niah_sample
from megabam.data.prepare import prepare_dataset
from megabam.data.sources import expand_inputs, read_documents
from megabam.data.streaming_import import import_streaming
from megabam.data.synth import synthetic_tokens
from megabam.data.tokenizer import Tokenizer, train_tokenizer
from megabam.data.training_data import prepared_mixture


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "sp.model"
    train_tokenizer(python_stdlib_documents(300_000), path, vocab_size=512)
    return path


def run_cli(capsys, *args):
    """``megabam`` in this process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *fragments):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megabam: error: "), err
    for fragment in fragments:
        assert fragment in lines[0]


def write_jsonl(path, texts, field="text"):
    data = "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


def random_texts(rng, n, max_words):
    words = ["alpha", "beta", "gamma", "delta", "x = 12", "def f():", "ünïcode", "\n", "    return"]
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(1, max_words))) for _ in range(n)]


def listing(path):
    return sorted(os.listdir(path))


# --- inputs ------------------------------------------------------------------------------------


def test_inputs_of_every_kind_are_read_in_order(tmp_path):
    rng = random.Random(0)
    texts = random_texts(rng, 12, 20)
    (tmp_path / "d" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "d" / "a.jsonl", texts[0:3], field="body")
    write_jsonl(tmp_path / "d" / "sub" / "b.jsonl.gz", texts[3:6], field="body")
    write_jsonl(tmp_path / "c.jsonl.zst", texts[6:9], field="body")
    (tmp_path / "e.txt.gz").write_bytes(gzip.compress(texts[9].encode()))
    (tmp_path / "f.txt").write_text("\n".join(texts[10:12]) + "\n")
    (tmp_path / "d" / "ignored.csv").write_text("not an input kind")

    paths = expand_inputs([str(tmp_path / "d"), str(tmp_path / "c.*"), str(tmp_path / "e.txt.gz")])
    assert [p.name for p in paths] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "e.txt.gz"]
    assert list(read_documents(paths, text_field="body")) == texts[:10]
    by_line = list(read_documents(expand_inputs([str(tmp_path / "f.txt")]), text_unit="line"))
    assert by_line == [line for t in texts[10:12] for line in t.split("\n")]


def test_mds_text_shards_are_an_input(tmp_path):
    streaming = import_streaming()
    texts = random_texts(random.Random(1), 30, 10)
    with streaming.MDSWriter(
        out=str(tmp_path / "mds"), columns={"text": "str"}, compression="zstd", size_limit=200
    ) as w:
        for t in texts:
            w.write({"text": t})
    assert list(read_documents(expand_inputs([str(tmp_path / "mds")]))) == texts
    (tmp_path / "notes.txt").write_text("beside the shards")
    assert list(read_documents(expand_inputs([str(tmp_path)]))) == texts + ["beside the shards"]
    with pytest.raises(DataError, match="no column 'body'"):
        list(read_documents(expand_inputs([str(tmp_path / "mds")]), text_field="body"))


def test_bad_utf8_fails_or_is_replaced_and_counted(tmp_path, tok_path, capsys):
    (tmp_path / "bad.txt").write_bytes(b"good line\nbad \xff\xfe byte\n")
    (tmp_path / "good.txt").write_text("fine text " * 400)
    code, _, err = run_cli(
        capsys,
        "data",
        "prepare",
        tmp_path / "good.txt",
        tmp_path / "bad.txt",
        "--out",
        tmp_path / "o",
        "--tokenizer",
        tok_path,
        "--seq-len",
        32,
        "--val-fraction",
        0,
        "--no-progress",
    )
    assert_one_line_error(code, err, "bad.txt", "not valid UTF-8", "--on-bad-utf8 replace")
    assert listing(tmp_path) == ["bad.txt", "good.txt"]  # nothing half-written
    code, out, _ = run_cli(
        capsys,
        "data",
        "prepare",
        tmp_path / "good.txt",
        tmp_path / "bad.txt",
        "--out",
        tmp_path / "o",
        "--tokenizer",
        tok_path,
        "--seq-len",
        32,
        "--val-fraction",
        0,
        "--no-progress",
        "--on-bad-utf8",
        "replace",
        "--text-unit",
        "line",
    )
    assert code == 0 and "non-UTF-8 replaced 1," in out


# --- prepare: packing every token exactly once -------------------------------------------------


def test_prepare_packs_every_token_once_with_boundaries(tmp_path, tok_path):
    seq_len, seed, val_fraction = 63, 5, 0.25
    rng = random.Random(3)
    texts = random_texts(rng, 150, 60) + ["word " * 300]  # the last is longer than a sample
    write_jsonl(tmp_path / "in.jsonl.gz", texts[:80])
    write_jsonl(tmp_path / "in2.jsonl", texts[80:] + [""])
    summary = prepare_dataset(
        [str(tmp_path / "in*")],
        tmp_path / "out",
        tok_path,
        seq_len,
        workers=2,
        val_fraction=val_fraction,
        seed=seed,
        compression=None,
        size_limit=2000,
    )

    # Independent reference: per-document encoding, the same seeded split, plain concatenation.
    tok = Tokenizer(tok_path)
    split_rng = random.Random(seed)
    streams = {"train": ([], []), "val": ([], [])}  # tokens, document begin offsets
    for text in texts:
        ids = tok.encode(text)
        tokens, begins = streams["val" if split_rng.random() < val_fraction else "train"]
        begins.append(len(tokens))
        tokens += ids + [tok.eos_id]
    streaming = import_streaming()
    sample_len = seq_len + 1
    for split, (tokens, begins) in streams.items():
        local = streaming.LocalDataset(local=str(tmp_path / "out" / split))
        n = len(tokens) // sample_len
        assert len(local) == n == summary.samples[split] > 0
        got = np.concatenate([local[i]["tokens"] for i in range(n)]).tolist()
        assert got == tokens[: n * sample_len]
        for i in range(n):
            want = sorted({0} | {b - i * sample_len for b in begins if i * sample_len <= b < (i + 1) * sample_len})
            assert local[i]["doc_starts"].tolist() == want
    assert summary.documents == len(texts) and summary.empty_skipped == 1
    assert summary.tokens == sum(len(t) for t, _ in streams.values())
    assert summary.tokens_dropped == sum(len(t) % sample_len for t, _ in streams.values())
    assert summary.long_documents_split == sum(len(tok.encode(t)) + 1 > sample_len for t in texts) >= 1
    assert summary.shards["train"] > 1
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["seq_len"] == seq_len and meta["vocab_size"] == 512
    assert listing(tmp_path / "out") == ["meta.json", "tokenizer.model", "train", "val"]
    assert listing(tmp_path) == ["in.jsonl.gz", "in2.jsonl", "out"]  # no temporary directory left

    reports = inspect_dataset(tmp_path / "out", n_decoded=1)
    assert [(r.name, r.samples, r.tokens) for r in reports] == [
        (s, summary.samples[s], summary.samples[s] * sample_len) for s in ("train", "val")
    ]
    assert reports[0].max_id < 512 and reports[0].decoded[0] == tok.decode(streams["train"][0][:sample_len])


def test_prepare_cli_summary_refusal_and_overwrite(tmp_path, tok_path, capsys):
    write_jsonl(tmp_path / "in.jsonl.zst", random_texts(random.Random(4), 200, 40))
    args = [
        "data",
        "prepare",
        tmp_path / "in.jsonl.zst",
        "--out",
        tmp_path / "out",
        "--tokenizer",
        tok_path,
        "--seq-len",
        31,
        "--val-fraction",
        0.2,
        "--size-limit",
        "1kb",
        "--no-progress",
    ]
    code, out, _ = run_cli(capsys, *args)
    assert code == 0
    for word in ("documents        200", "tokens ", "samples          train", "shards ", "tokens/s"):
        assert word in out
    before = (tmp_path / "out" / "meta.json").read_text()
    code, _, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, str(tmp_path / "out"), "already exists", "--overwrite")
    assert (tmp_path / "out" / "meta.json").read_text() == before
    code, _, _ = run_cli(capsys, *args, "--overwrite", "--seq-len", 15)
    assert code == 0 and json.loads((tmp_path / "out" / "meta.json").read_text())["seq_len"] == 15
    assert listing(tmp_path) == ["in.jsonl.zst", "out"]

    code, out, _ = run_cli(capsys, "data", "inspect", tmp_path / "out")
    assert code == 0
    for word in ("== train", "== val", "sha1 hashes verified", "token ids", "most frequent", "sample 0"):
        assert word in out


def test_failure_mid_run_leaves_nothing(tmp_path, tok_path, capsys):
    texts = random_texts(random.Random(6), 300, 40)
    lines = [json.dumps({"text": t}) for t in texts]
    lines[250] = "{broken json"
    (tmp_path / "in.jsonl").write_text("\n".join(lines))
    code, _, err = run_cli(
        capsys,
        "data",
        "prepare",
        tmp_path / "in.jsonl",
        "--out",
        tmp_path / "out",
        "--tokenizer",
        tok_path,
        "--seq-len",
        15,
        "--workers",
        0,
        "--no-progress",
    )
    assert_one_line_error(code, err, "in.jsonl:251", "not a JSON object")
    assert listing(tmp_path) == ["in.jsonl"]


# --- bad input ---------------------------------------------------------------------------------


def test_missing_and_empty_inputs(tmp_path, tok_path, capsys):
    common = ["--out", tmp_path / "out", "--tokenizer", tok_path, "--seq-len", 15, "--no-progress"]
    code, _, err = run_cli(capsys, "data", "prepare", tmp_path / "nope.jsonl", *common)
    assert_one_line_error(code, err, "nope.jsonl", "does not exist")
    code, _, err = run_cli(capsys, "data", "prepare", str(tmp_path / "*.txt"), *common)
    assert_one_line_error(code, err, "matches nothing")
    (tmp_path / "empty.txt").write_text("")
    write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    code, _, err = run_cli(capsys, "data", "prepare", tmp_path / "empty.txt", tmp_path / "blank.jsonl", *common)
    assert_one_line_error(code, err, "no non-empty document")
    (tmp_path / "e").mkdir()
    code, _, err = run_cli(capsys, "data", "prepare", tmp_path / "e", *common)
    assert_one_line_error(code, err, "holds no")
    code, _, err = run_cli(
        capsys, "data", "tokenizer", tmp_path / "empty.txt", "--out", tmp_path / "t.model", "--vocab-size", 300
    )
    assert_one_line_error(code, err, "no non-empty document")
    assert listing(tmp_path) == ["blank.jsonl", "e", "empty.txt"]


def write_prepared(tmp_path, tok_path, name="ds", seq_len=15):
    write_jsonl(tmp_path / f"{name}.jsonl", random_texts(random.Random(len(name)), 120, 30))
    prepare_dataset(
        [str(tmp_path / f"{name}.jsonl")],
        tmp_path / name,
        tok_path,
        seq_len,
        workers=0,
        val_fraction=0.2,
        size_limit=600,
    )
    return tmp_path / name


def test_corrupted_and_truncated_shards_are_refused(tmp_path, tok_path, capsys):
    ds = write_prepared(tmp_path, tok_path)
    shard = sorted((ds / "train").glob("shard.*"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x55
    shard.write_bytes(bytes(data))
    code, _, err = run_cli(capsys, "data", "inspect", ds)
    assert_one_line_error(code, err, shard.name, "sha1 hash mismatch")
    shard.write_bytes(bytes(data[:-10]))
    code, _, err = run_cli(capsys, "data", "inspect", ds)
    assert_one_line_error(code, err, shard.name, "truncated")
    with pytest.raises(DataError, match=f"{shard.name}: shard truncated"):  # what the trainer checks
        prepared_mixture([StreamConfig(path=str(ds))], tok_path, vocab_size=512, seq_len=15)


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path, tok_path, capsys):
    ds = write_prepared(tmp_path, tok_path)
    code, _, err = run_cli(capsys, "data", "inspect", ds, "--vocab-size", 100)
    assert_one_line_error(code, err, "token id", "outside the vocabulary of 100")


def test_tokenizer_vocab_must_match_the_model(tmp_path, tok_path, capsys):
    code, _, err = run_cli(capsys, "data", "tokenizer", "--load", tok_path, "--vocab-size", 4096)
    assert_one_line_error(code, err, "512 pieces", "model.vocab_size is 4096")
    ds = write_prepared(tmp_path, tok_path)
    streams = [StreamConfig(path=str(ds))]
    with pytest.raises(DataError, match="512 pieces but model.vocab_size is 4096"):
        prepared_mixture(streams, tok_path, vocab_size=4096, seq_len=15)
    with pytest.raises(DataError, match="prepared for seq_len 15, data.seq_len is 16"):
        prepared_mixture(streams, tok_path, vocab_size=512, seq_len=16)
    data = prepared_mixture(streams, tok_path, vocab_size=512, seq_len=15)
    assert [(s.split, s.local) for s in data.train + data.val] == [("train", str(ds)), ("val", str(ds))]


def test_mixture_weights_must_be_positive():
    for weight in (0.0, -1.0):
        with pytest.raises(DataError, match="weight must be positive"):
            check_streams([StreamSpec("a", weight=1.0), StreamSpec("b", weight=weight)])
    with pytest.raises(DataError, match="every stream"):
        check_streams([StreamSpec("a", weight=1.0), StreamSpec("b")])


# --- tokenizer command -------------------------------------------------------------------------


def test_tokenizer_command_trains_with_special_tokens(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    for i, text in enumerate(python_stdlib_documents(200_000)):
        write_jsonl(tmp_path / "c" / f"{i}.jsonl.gz", [text])
    code, out, _ = run_cli(
        capsys,
        "data",
        "tokenizer",
        tmp_path / "c",
        "--out",
        tmp_path / "t.model",
        "--vocab-size",
        400,
        "--model-type",
        "unigram",
        "--special",
        "<|sep|>",
        "<|user|>",
    )
    assert code == 0 and "400 pieces (unigram)" in out
    tok = Tokenizer(tmp_path / "t.model")
    assert tok.vocab_size == 400 and tok.eos_id == 3
    ids = tok.encode("a<|sep|>b<|user|>")
    assert [tok.decode([i]) for i in ids if tok.decode([i]).startswith("<|")] == ["<|sep|>", "<|user|>"]
    assert listing(tmp_path) == ["c", "t.model"]  # written atomically, nothing else left
    code, out, _ = run_cli(capsys, "data", "tokenizer", "--load", tmp_path / "t.model", "--vocab-size", 400)
    assert code == 0 and "400 pieces" in out


@pytest.mark.parametrize("command", ["tokenizer", "prepare", "inspect", "synth"])
def test_data_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["data", command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: megabam data {command}" in capsys.readouterr().out


# --- synthetic retrieval tasks -----------------------------------------------------------------


@pytest.mark.parametrize("variant", ["single_1", "single_2", "single_3"])
def test_niah_sample_places_needle_at_depth(tok_path, variant):
    tok = Tokenizer(tok_path)
    for depth in (0.0, 0.4, 1.0):
        s = niah_sample(tok, 1500, depth, variant, random.Random(7), essay="An essay sentence. " * 50)
        assert len(s.prompt_ids) == 1500
        text = tok.decode(s.prompt_ids)
        assert tok.decode(s.answer_ids).strip() == s.answer
        assert (len(s.answer) == 36) if variant == "single_3" else (len(s.answer) == 7 and s.answer.isdigit())
        needle_at = text.index(f"is: {s.answer}.")
        key = text.rsplit("What is the special magic ", 1)[1].split(" for ", 1)[1].split(" mentioned")[0]
        assert f"for {key} is: {s.answer}." in text
        hay_start, hay_end = text.index("afterwards.") + 11, text.index(" What is the special magic")
        assert abs((needle_at - hay_start) / (hay_end - hay_start) - depth) < 0.08


def test_synth_writes_a_mixable_dataset(tmp_path, tok_path, capsys):
    tok = Tokenizer(tok_path)
    for kind in ("passkey", "niah_single_1", "niah_single_3"):
        assert len(synthetic_tokens(kind, tok, 300, random.Random(1))) == 300
    code, out, _ = run_cli(
        capsys,
        "data",
        "synth",
        "passkey",
        "--out",
        tmp_path / "pk",
        "--tokenizer",
        tok_path,
        "--seq-len",
        255,
        "--train",
        6,
        "--val",
        2,
    )
    assert code == 0 and "6 train and 2 val samples of 256 tokens" in out
    (report, _) = inspect_dataset(tmp_path / "pk", n_decoded=6)
    assert report.samples == 6 and report.tokens == 6 * 256
    for text in report.decoded:
        assert text.startswith("There is an important info") and "What is the pass key? The pass key is" in text
    data = prepared_mixture([StreamConfig(path=str(tmp_path / "pk"), weight=1.0)], tok_path, 512, 255)
    assert data.train[0].split == "train" and data.val[0].split == "val"
    code, _, err = run_cli(
        capsys,
        "data",
        "synth",
        "passkey",
        "--out",
        tmp_path / "short",
        "--tokenizer",
        tok_path,
        "--seq-len",
        40,
        "--train",
        1,
    )
    assert_one_line_error(code, err, "too short")
    assert not (tmp_path / "short").exists()


def _digests(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "args, message",
    [
        (["tokenizer", "{inputs}", "--out", "{tmp}", "--vocab-size", "300"], "is a directory"),
        (["tokenizer", "{inputs}", "--out", "{model}", "--vocab-size", "300"], "exists; pass --overwrite"),
        (
            ["prepare", "{inputs}", "--out", "{tmp}/p", "--tokenizer", "{model}", "--seq-len", "8", "--workers", "-1"],
            "--workers: must be 0",
        ),
        (
            [
                "prepare",
                "{inputs}",
                "--out",
                "{tmp}/p",
                "--tokenizer",
                "{model}",
                "--seq-len",
                "8",
                "--compression",
                "bogus",
            ],
            "--compression: unknown 'bogus'",
        ),
        (
            [
                "prepare",
                "{inputs}",
                "--out",
                "{tmp}/p",
                "--tokenizer",
                "{model}",
                "--seq-len",
                "8",
                "--size-limit",
                "lots",
            ],
            "--size-limit: 'lots' is not a size",
        ),
        (
            [
                "synth",
                "niah_single_2",
                "--out",
                "{tmp}/s",
                "--tokenizer",
                "{model}",
                "--seq-len",
                "64",
                "--train",
                "2",
                "--essay",
                "{tmp}/missing.txt",
            ],
            "cannot read",
        ),
        (
            [
                "synth",
                "niah_single_2",
                "--out",
                "{tmp}/s",
                "--tokenizer",
                "{model}",
                "--seq-len",
                "64",
                "--train",
                "2",
                "--essay",
                "{binary}",
            ],
            "not UTF-8 text",
        ),
    ],
    ids=[
        "tokenizer-out-dir",
        "tokenizer-out-exists",
        "workers",
        "compression",
        "size-limit",
        "essay-missing",
        "essay-binary",
    ],
)
def test_bad_data_command_arguments_are_one_line_errors_that_change_nothing(tmp_path, tok_path, capsys, args, message):
    (tmp_path / "in.txt").write_text("some text to read\n")
    model = tmp_path / "sp.model"
    model.write_bytes(tok_path.read_bytes())
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe text")
    before = _digests(tmp_path)
    filled = [
        a.format(inputs=tmp_path / "in.txt", tmp=tmp_path, model=model, binary=tmp_path / "binary.txt") for a in args
    ]
    code, _, err = run_cli(capsys, "data", *filled)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert _digests(tmp_path) == before
