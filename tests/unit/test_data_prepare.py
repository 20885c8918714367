"""`megabam data tokenizer|prepare|inspect|synth`: inputs, packing, shards, summaries and bad input."""

import gzip
import hashlib
import json
import os
import random

import numpy as np
import pytest
import zstandard
from helpers.prepared import prepared_samples

from megabam.cli import main
from megabam.config.schema import StreamConfig
from megabam.data.corpus import python_stdlib_documents
from megabam.data.errors import DataError
from megabam.data.inspect_data import inspect_dataset
from megabam.data.mixture import StreamSpec, check_streams
from megabam.data.niah import niah_sample
from megabam.data.prepare import prepare_dataset
from megabam.data.sources import expand_inputs, pieces, read_documents
from megabam.data.streaming_import import import_streaming
from megabam.data.synth import synthetic_tokens
from megabam.data.tokenizer import open_tokenizer, train_tokenizer
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


def test_parquet_arrow_and_datasets_folders_give_the_jsonl_token_stream(tmp_path, tok_path, capsys):
    """The same documents as Parquet (several row groups), Arrow IPC (file and stream format), a folder
    `datasets` saved (several Arrow files; its JSON metadata beside them) and a hub download (README.md,
    data/SPLIT-0000x-of-0000n.parquet) prepare to the samples their JSON Lines form gives; only the
    asked split of a folder holding several is read."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts, other = random_texts(random.Random(7), 300, 40), random_texts(random.Random(8), 50, 40)
    table = pa.table({"id": list(range(len(texts))), "text": texts})
    write_jsonl(tmp_path / "ref.jsonl", texts)
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=37)
    with pa.ipc.new_file(tmp_path / "docs.arrow", table.schema) as w:
        for batch in table.to_batches(max_chunksize=41):
            w.write_batch(batch)
    with pa.ipc.new_stream(tmp_path / "stream.arrow", table.schema) as w:
        w.write_table(table, max_chunksize=41)
    saved = datasets.Dataset.from_dict({"text": texts})
    saved.save_to_disk(tmp_path / "saved", num_shards=3)
    datasets.DatasetDict({"train": saved, "test": datasets.Dataset.from_dict({"text": other})}).save_to_disk(
        tmp_path / "dict"
    )
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("---\nlicense: mit\n---\n# a dataset card, not a document\n")
    pq.write_table(table.slice(0, 120), hub / "data" / "train-00000-of-00002.parquet")
    pq.write_table(table.slice(120), hub / "data" / "train-00001-of-00002.parquet")
    pq.write_table(pa.table({"text": other}), hub / "data" / "test-00000-of-00001.parquet")
    assert (tmp_path / "saved" / "dataset_info.json").is_file() and len(list((tmp_path / "saved").glob("*.arrow"))) == 3

    def prepare(source, *extra):
        out = tmp_path / f"out-{source}-{len(extra)}"
        args = ["data", "prepare", tmp_path / source, "--out", out, "--tokenizer", tok_path, "--seq-len", 31]
        code, _, err = run_cli(capsys, *args, "--val-fraction", 0.1, "--workers", 0, "--no-progress", *extra)
        assert code == 0, err
        return prepared_samples(out)

    reference = prepare("ref.jsonl")
    assert len(reference["train"]) > 20 and len(reference["val"]) > 0
    for source in ("docs.parquet", "docs.arrow", "stream.arrow", "saved", "dict", "hub"):
        assert prepare(source) == reference, source
    write_jsonl(tmp_path / "test.jsonl", other)
    test_split = prepare("test.jsonl")
    assert prepare("dict", "--hf-split", "test") == test_split != reference
    assert prepare("hub", "--hf-split", "test") == test_split
    assert list(read_documents(expand_inputs([str(tmp_path / "hub"), str(tmp_path / "dict")]))) == texts + texts
    assert list(read_documents(expand_inputs([str(tmp_path / "hub")], hf_split="test"))) == other


def test_the_pieces_of_a_file_read_each_document_once(tmp_path):
    """Cut anywhere, the pieces of a line-based file read each line once (the one that begins inside
    them, a line's own bytes and UTF-8 characters never split); Parquet and Arrow files are cut between
    row groups and batches; files that cannot be cut stay whole."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = random_texts(random.Random(3), 40, 12) + ["", "last"]
    write_jsonl(tmp_path / "a.jsonl", texts)
    (tmp_path / "a.txt").write_bytes(("\n".join(texts) + "\r\n\n\nünï").encode())
    for name, unit in (("a.jsonl", "file"), ("a.txt", "line")):
        path = tmp_path / name
        whole = list(read_documents([path], text_unit=unit))
        data, size = path.read_bytes(), path.stat().st_size
        line_starts = [0] + [i + 1 for i, byte in enumerate(data[:-1]) if byte == ord("\n")]
        for cut in range(size + 1):
            halves = [list(read_documents([path], text_unit=unit, span=s)) for s in ([0, cut], [cut, size])]
            assert halves[0] + halves[1] == whole, (name, cut)
            assert len(halves[0]) == len(read_documents_of(path, unit, [b for b in line_starts if b < cut]))
        spans = pieces(path, size, unit, 300)
        assert len(spans) == -(-size // 300) and sum(n for _, n in spans) == size
        assert [x for s, _ in spans for x in read_documents([path], text_unit=unit, span=s)] == whole
    assert pieces(tmp_path / "a.txt", 10_000, "file", 300) == [(None, 10_000)]  # a document per file
    write_jsonl(tmp_path / "a.jsonl.gz", texts)
    assert pieces(tmp_path / "a.jsonl.gz", 10_000, "file", 300) == [(None, 10_000)]  # no seeking in gzip

    table = pa.table({"text": texts})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=5)
    with pa.ipc.new_file(tmp_path / "a.arrow", table.schema) as w:
        w.write_table(table, max_chunksize=7)
    with pa.ipc.new_stream(tmp_path / "s.arrow", table.schema) as w:
        w.write_table(table, max_chunksize=7)
    for name in ("a.parquet", "a.arrow"):
        path = tmp_path / name
        size = path.stat().st_size
        spans = pieces(path, size, "file", size // 4)
        assert 3 <= len(spans) and sum(n for _, n in spans) == size
        assert [x for s, _ in spans for x in read_documents([path], span=s)] == [t for t in texts if t]
    assert pieces(tmp_path / "s.arrow", 10_000, "file", 300) == [(None, 10_000)]  # a stream has no batch index


def read_documents_of(path, unit, starts):
    """The non-empty documents of the lines beginning at byte offsets `starts`, read plainly."""
    data = path.read_bytes()
    lines = [data[b:].split(b"\n", 1)[0] for b in starts]
    if unit == "line":
        return [x for x in (line.decode().rstrip("\r") for line in lines) if x]
    return [t for t in (json.loads(line)["text"] for line in lines if line.strip()) if t]


def test_columnar_inputs_refuse_a_missing_column_a_corrupt_file_and_a_missing_split(tmp_path, tok_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a b c"] * 10, "id": list(range(10))}), tmp_path / "a.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + os.urandom(200))
    pq.write_table(pa.table({"text": list(range(10))}), tmp_path / "ints.parquet")
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("card")
    pq.write_table(pa.table({"text": ["x"]}), hub / "data" / "train-00000-of-00001.parquet")
    base = ["--out", tmp_path / "out", "--tokenizer", tok_path, "--seq-len", 31, "--no-progress"]
    for source, extra, fragments in [
        ("a.parquet", [], ["a.parquet", "no column 'text' (columns: content, id; set it with --field)"]),
        ("bad.parquet", [], ["bad.parquet", "cannot read as parquet"]),
        ("ints.parquet", [], ["ints.parquet", "column 'text' holds int64, not text"]),
        ("hub", ["--hf-split", "validation"], [str(hub), "no split 'validation' (splits: train;"]),
    ]:
        code, _, err = run_cli(capsys, "data", "prepare", tmp_path / source, *base, *extra)
        assert_one_line_error(code, err, *fragments)
        assert not (tmp_path / "out").exists()
    code, out, err = run_cli(
        capsys, "data", "prepare", tmp_path / "a.parquet", *base, "--field", "content", "--val-fraction", 0
    )
    assert code == 0 and "documents        10 " in out, err


def test_a_tokenizer_json_converted_from_a_sentencepiece_model_tokenizes_alike(tmp_path, tok_path, capsys):
    """transformers' conversion of the sentencepiece model (megabam's export writes it) read back through
    the tokenizers library as a save_pretrained folder and as a bare tokenizer.json: the same ids for every
    text, the same special tokens, the same prepared samples; the output carries tokenizer.json and its
    config, and inspect decodes with it."""
    from megabam.convert.hf_export import write_tokenizer
    from megabam.data.tokenizer import HFTokenizer, load_tokenizer

    sp = open_tokenizer(tok_path)
    write_tokenizer(sp, tmp_path / "folder", 256)
    (tmp_path / "folder" / "tokenizer.model").unlink()  # else the folder's sentencepiece model is read
    folder = load_tokenizer(tmp_path / "folder", expected_vocab_size=512)
    assert isinstance(folder, HFTokenizer) and folder.path == tmp_path / "folder" / "tokenizer.json"
    texts = random_texts(random.Random(11), 200, 30) + python_stdlib_documents(60_000)[:40] + ["", " 12345 ", "\t\n"]
    assert [folder.encode(t) for t in texts] == [sp.encode(t) for t in texts]
    assert [folder.decode(sp.encode(t)) for t in texts] == [sp.decode(sp.encode(t)) for t in texts]
    assert (folder.vocab_size, folder.pad_id, folder.bos_id, folder.eos_id) == (512, sp.pad_id, sp.bos_id, sp.eos_id)
    write_jsonl(tmp_path / "in.jsonl", texts)
    for name, tokenizer in [("sp", tok_path), ("folder", tmp_path / "folder"), ("json", folder.path)]:
        args = ["data", "prepare", tmp_path / "in.jsonl", "--out", tmp_path / f"out-{name}", "--tokenizer", tokenizer]
        code, _, err = run_cli(capsys, *args, "--seq-len", 31, "--val-fraction", 0.1, "--no-progress")
        assert code == 0, err
    assert (
        prepared_samples(tmp_path / "out-folder")
        == prepared_samples(tmp_path / "out-json")
        == prepared_samples(tmp_path / "out-sp")
    )
    assert listing(tmp_path / "out-json") == ["meta.json", "tokenizer.json", "tokenizer_config.json", "train", "val"]
    code, out, _ = run_cli(capsys, "data", "inspect", tmp_path / "out-json", "--samples", 1)
    assert code == 0 and "sample 0" in out
    code, out, _ = run_cli(capsys, "data", "tokenizer", "--load", tmp_path / "out-json" / "tokenizer.json")
    assert code == 0 and out.strip().endswith(f"512 pieces, pad {sp.pad_id}, bos {sp.bos_id}, eos {sp.eos_id}")


def test_a_llama_3_style_tokenizer_json_alone_gives_exact_length_passkey_and_needle_prompts(tmp_path):
    """A bare tokenizer.json (no config beside it): bos from its post-processor's template, eos from
    its special tokens. Prompts are joined from separately encoded pieces, so their lengths are exact
    whatever the tokenizer; the key is tokenized as the tokenizer does (here digit by digit: three-digit
    groups need merges this small vocabulary lacks) and the answer decodes back to it."""
    from helpers.hf_tokenizer import BOS, EOS, write_hf_tokenizer

    from megabam.data.passkey import passkey_sample
    from megabam.data.tokenizer import load_tokenizer

    tok = load_tokenizer(write_hf_tokenizer(tmp_path / "llama3" / "tokenizer.json"))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (tok._tok.token_to_id(BOS), tok._tok.token_to_id(EOS), None)
    for n in (300, 701, 1500):
        for depth in (0.0, 0.5, 1.0):
            sample = passkey_sample(tok, n, depth, "40713")
            assert len(sample.prompt_ids) == n and tok.decode(sample.answer_ids) == " 40713"
            assert "The pass key is 40713. Remember it." in tok.decode(sample.prompt_ids)
        needle = niah_sample(tok, n, 0.5, "single_1", random.Random(0))
        assert len(needle.prompt_ids) == n
    assert tok.config_for_copy() == {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}


@pytest.mark.parametrize(
    "name, make, fragments",
    [
        ("tok", lambda p: p.mkdir(), ["tok: a tokenizer folder without tokenizer.model or tokenizer.json"]),
        ("tokenizer.json", lambda p: p.write_text("{not json"), ["tokenizer.json: not a Hugging Face tokenizer.json"]),
        ("tok.model", lambda p: p.write_bytes(os.urandom(300)), ["tok.model: not a sentencepiece model"]),
        (None, None, ["meta-llama/Llama-3.1-8B", "not a local path (a hub id?)", "nothing is downloaded"]),
    ],
    ids=["empty-folder", "bad-json", "bad-model", "hub-id"],
)
def test_tokenizers_that_cannot_be_used_are_one_line_errors(tmp_path, capsys, name, make, fragments):
    (tmp_path / "in.txt").write_text("some text " * 100)
    tokenizer = "meta-llama/Llama-3.1-8B" if name is None else tmp_path / name
    if make is not None:
        make(tokenizer)
    args = ["data", "prepare", tmp_path / "in.txt", "--out", tmp_path / "out", "--tokenizer", tokenizer]
    code, _, err = run_cli(capsys, *args, "--seq-len", 15)
    assert_one_line_error(code, err, *fragments)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_json_without_an_end_of_sequence_token_is_refused(tmp_path):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models

    from megabam.data.tokenizer import load_tokenizer

    RustTokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(tmp_path / "t.json"))
    with pytest.raises(DataError, match=r"t.json: no end-of-sequence token .* give its save_pretrained folder"):
        load_tokenizer(tmp_path / "t.json")


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
    ).summary

    # Independent reference: per-document encoding, the same seeded split (one task here: the inputs
    # are far under --task-size; its draws are random.Random("SEED/TASK")), plain concatenation.
    tok = open_tokenizer(tok_path)
    split_rng = random.Random(f"{seed}/0")
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
    assert_one_line_error(code, err, "a directory without .txt/.jsonl")
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
    shard = sorted((ds / "train").rglob("shard.*"))[1]
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
    # Garbage of the right size whose index was re-signed to match: the decoder's failure is one line.
    shard.write_bytes(os.urandom(len(data)))
    index_path = ds / "train" / "index.json"
    index = json.loads(index_path.read_text())
    name = shard.relative_to(ds / "train").as_posix()
    for entry in index["shards"]:
        for part in (entry["raw_data"], entry.get("zip_data") or {}):
            if part.get("basename") == name:
                part["hashes"] = {"sha1": hashlib.sha1(shard.read_bytes()).hexdigest()}
    index_path.write_text(json.dumps(index))
    code, _, err = run_cli(capsys, "data", "inspect", ds)
    assert_one_line_error(code, err, shard.name, "not a readable MDS shard")


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path, tok_path, capsys):
    ds = write_prepared(tmp_path, tok_path)
    code, _, err = run_cli(capsys, "data", "inspect", ds, "--vocab-size", 100)
    assert_one_line_error(code, err, "token id", "outside the vocabulary of 100")


def test_tokenizer_vocab_must_match_the_model(tmp_path, tok_path, capsys):
    code, _, err = run_cli(capsys, "data", "tokenizer", "--load", tok_path, "--vocab-size", 4096)
    assert_one_line_error(code, err, "model.vocab_size: 4096, but the tokenizer has 512 pieces")
    ds = write_prepared(tmp_path, tok_path)
    streams = [StreamConfig(path=str(ds))]
    with pytest.raises(DataError, match="model.vocab_size: 4096, but the tokenizer has 512 pieces"):
        prepared_mixture(streams, tok_path, vocab_size=4096, seq_len=15)
    with pytest.raises(DataError, match="data.seq_len: 16, but stream 0 was prepared for seq_len 15"):
        prepared_mixture(streams, tok_path, vocab_size=512, seq_len=16)
    data = prepared_mixture(streams, tok_path, vocab_size=512, seq_len=15)
    assert [(s.split, s.local) for s in data.train + data.val] == [("train", str(ds)), ("val", str(ds))]
    # Raw input given where a prepared dataset belongs: the command that prepares it.
    write_jsonl(tmp_path / "raw.jsonl", ["some text"])
    with pytest.raises(DataError) as raised:
        prepared_mixture([StreamConfig(path=str(tmp_path / "raw.jsonl"))], tok_path, vocab_size=512, seq_len=15)
    assert str(raised.value) == (
        f"{tmp_path / 'raw.jsonl'}: data.streams[0]: not a prepared dataset (no train/index.json); training reads "
        f"what `megabam data prepare {tmp_path / 'raw.jsonl'} --out DIR --tokenizer {tok_path} --seq-len 15` "
        "writes (from text, JSON Lines, Parquet, Arrow or a datasets folder)"
    )


def test_mixture_weights_must_be_positive():
    for weight in (0.0, -1.0):
        with pytest.raises(DataError, match=r"data.streams\[1\].weight: must be positive"):
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
    tok = open_tokenizer(tmp_path / "t.model")
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
    tok = open_tokenizer(tok_path)
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
    tok = open_tokenizer(tok_path)
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
