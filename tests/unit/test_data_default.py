"""The default data path: packing, tokenizer, passkey, MDS shards, loaders, the cached build."""

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megabam.data import default_dataset as default_dataset_module
from megabam.data.corpus import python_stdlib_documents
from megabam.data.default_dataset import build_default_dataset
from megabam.data.loader import build_loader
from megabam.data.packing import doc_ids_from_starts, pack_documents
from megabam.data.passkey import (
    FILLER_SENTENCES,
    INSTRUCTION,
    NEEDLE,
    QUESTION,
    TrainingPasskeys,
    passkey_sample,
    passkey_training_tokens,
    random_key,
)
from megabam.data.shards import write_mds
from megabam.data.streaming_import import import_streaming
from megabam.data.tokenizer import open_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    docs = python_stdlib_documents(300_000)
    return train_tokenizer(docs, tmp_path_factory.mktemp("tok") / "sp.model", vocab_size=512)


def random_docs(rng, n, max_len):
    return [[rng.randrange(4, 1000) for _ in range(rng.randrange(0, max_len))] for _ in range(n)]


def expected_samples(docs, sample_len, eos):
    """Plain reference: the eos-joined stream cut into full samples, plus where documents begin."""
    stream, begins = [], []
    for doc in docs:
        begins.append(len(stream))
        stream += list(doc) + [eos]
    out = []
    for j in range(len(stream) // sample_len):
        lo, hi = j * sample_len, (j + 1) * sample_len
        starts = sorted({0} | {b - lo for b in begins if lo <= b < hi})
        out.append((stream[lo:hi], starts))
    return out


def packed_samples(n_samples, sample_len, seed=0):
    rng = random.Random(seed)
    docs = random_docs(rng, 4 * n_samples, 2 * sample_len)
    return list(pack_documents(docs, sample_len, eos_id=3))[:n_samples]


# --- packing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sample_len", [1, 7, 64])
def test_pack_documents_matches_plain_concatenation(sample_len):
    docs = random_docs(random.Random(sample_len), 50, 3 * sample_len + 5) + [[], [5, 6]]
    got = list(pack_documents(docs, sample_len, eos_id=3))
    want = expected_samples(docs, sample_len, eos=3)
    assert len(got) == len(want) > 0
    for sample, (tokens, starts) in zip(got, want):
        assert sample.tokens.dtype == np.int32 and sample.doc_starts.dtype == np.int32
        assert sample.tokens.shape == (sample_len,)
        assert sample.tokens.tolist() == tokens
        assert sample.doc_starts.tolist() == starts


def test_pack_documents_drops_incomplete_remainder():
    assert list(pack_documents([[5, 6, 7]], sample_len=5, eos_id=3)) == []
    (only,) = pack_documents([[5, 6, 7], [8, 9, 10]], sample_len=5, eos_id=3)
    assert only.tokens.tolist() == [5, 6, 7, 3, 8]
    assert only.doc_starts.tolist() == [0, 4]


def test_doc_ids_from_starts():
    assert doc_ids_from_starts(np.array([0, 3, 5]), 7).tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert doc_ids_from_starts(np.array([0]), 4).tolist() == [0, 0, 0, 0]
    # A start at the very last token of a sample lies past the inputs (sample_len - 1 of them).
    assert doc_ids_from_starts(np.array([0, 2, 4]), 4).tolist() == [0, 0, 1, 1]


# --- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_round_trips_and_has_exact_vocab(tokenizer, tmp_path):
    assert tokenizer.vocab_size == 512
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 2, 3)
    text = python_stdlib_documents(400_000)[-1] + "\n\tünïcode ✓ 中文  trailing  \n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    reloaded = open_tokenizer(tokenizer.path)
    assert reloaded.encode(text) == tokenizer.encode(text)
    assert sorted(os.listdir(tokenizer.path.parent)) == [tokenizer.path.name]  # no temp files left


def test_tokenizer_splits_digits(tokenizer):
    ids = tokenizer.encode("x = 1234567890")
    pieces = [tokenizer.decode([i]) for i in ids]
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digit_pieces == list("1234567890")
    for i in range(tokenizer.vocab_size):
        assert sum(c.isdigit() for c in tokenizer.decode([i])) <= 1


# --- passkey -----------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.75, 1.0])
def test_passkey_sample_places_needle_at_depth(tokenizer, depth):
    n_tokens = 2000
    sample = passkey_sample(tokenizer, n_tokens, depth, "71432")
    assert n_tokens - 30 <= len(sample.prompt_ids) <= n_tokens
    assert tokenizer.decode(sample.answer_ids).strip() == "71432"
    text = tokenizer.decode(sample.prompt_ids)
    assert text.startswith("There is an important info hidden inside a lot of irrelevant text.")
    assert text.endswith("What is the pass key? The pass key is")
    needle = "The pass key is 71432. Remember it. 71432 is the pass key."
    assert text.count(needle) == 1
    filler_start = text.index("The grass is green.")
    filler_end = text.index("What is the pass key?")
    filler_len = filler_end - filler_start - len(needle)
    relative = (text.index(needle) - filler_start) / filler_len
    assert abs(relative - depth) < 0.03


def test_passkey_training_tokens(tokenizer):
    rng = random.Random(0)
    keys = {random_key(rng) for _ in range(100)}
    assert all(len(k) == 5 and k.isdigit() for k in keys) and len(keys) > 90
    for _ in range(5):
        ids = passkey_training_tokens(tokenizer, 300, rng)
        assert 280 <= len(ids) <= 300
        text = tokenizer.decode(ids)
        key = text.rsplit(" ", 1)[1]
        assert text.endswith(f"What is the pass key? The pass key is {key}") and key.isdigit()
        assert f"The pass key is {key}. Remember it." in text


@pytest.mark.parametrize("digits", [(5, 5), (3, 7)])
@pytest.mark.parametrize("end", ["eos", "period"])
def test_passkey_training_answer_styles(tokenizer, digits, end):
    """Keys of the drawn lengths, the same in needle and answer, the answer's tokens those the
    evaluation scores (the key as `passkey_sample` encodes it), then a period if asked; and the
    default style draws exactly the documents of a plain build from `random_key` and `passkey_sample`."""
    rng, plain = random.Random(7), random.Random(7)
    lengths = set()
    for _ in range(60):
        ids = passkey_training_tokens(tokenizer, 300, rng, TrainingPasskeys(key_digits=digits, answer_end=end))
        assert len(ids) <= 300
        text = tokenizer.decode(ids)
        key = re.search(r"The pass key is (\d+)\. Remember it\. \1 is the pass key\.", text).group(1)
        lengths.add(len(key))
        tail = f"{QUESTION} {key}" + ("." if end == "period" else "")
        assert text.endswith(tail) and text.count(key) == 3
        scored = tokenizer.encode(f" {key}")  # what the evaluation scores (passkey_sample's answer_ids)
        answer = ids[len(ids) - len(scored) - (end == "period") :]
        assert answer[: len(scored)] == scored and (end == "eos" or tokenizer.decode(answer[-1:]) == ".")
        if digits == (5, 5) and end == "eos":
            key = random_key(plain)
            sample = passkey_sample(tokenizer, 300 - len(scored), plain.random(), key)
            assert ids == sample.prompt_ids + sample.answer_ids
    assert lengths == set(range(digits[0], digits[1] + 1))


def filler_sentences(text: str, key: str) -> tuple[list[str], str]:
    """The whole filler sentences of a decoded training document, in order, and the cut-off rest."""
    body = text[len(INSTRUCTION) : text.index(QUESTION)].replace(NEEDLE.format(key=key), "", 1)
    sentences = re.findall(r" [^.]*\.", body)
    return sentences, body[len("".join(sentences)) :]


@pytest.mark.parametrize("vary", [False, True])
def test_passkey_training_filler(tokenizer, vary):
    """The evaluation's filler, or (vary) one to five of its sentences in random order, repeated."""
    rng = random.Random(5)
    units, style = [], TrainingPasskeys(filler="varied" if vary else "fixed")
    for _ in range(40):
        text = tokenizer.decode(passkey_training_tokens(tokenizer, 400, rng, style))
        key = text.rsplit(" ", 1)[1]
        assert text.startswith(INSTRUCTION) and text.endswith(f"{QUESTION} {key}")
        sentences, rest = filler_sentences(text, key)
        assert set(sentences) <= set(FILLER_SENTENCES)
        period = next((i for i in range(1, len(sentences)) if sentences[i] == sentences[0]), len(sentences))
        unit = sentences[:period]
        assert len(set(unit)) == len(unit) and sentences == [unit[i % period] for i in range(len(sentences))]
        assert unit[len(sentences) % period].startswith(rest)  # cut short inside the next sentence
        units.append(tuple(unit))
    if not vary:
        assert set(units) == {FILLER_SENTENCES}
    else:  # every unit size and more than one order
        assert {len(u) for u in units} == {1, 2, 3, 4, 5}
        assert len({u for u in units if len(u) == 5}) > 1 or len(set(units)) > 20


@pytest.mark.parametrize("min_tokens", [None, 200, 300])
def test_passkey_samples_hold_whole_documents(tokenizer, min_tokens):
    rng = random.Random(3)
    counts = set()
    for _ in range(20):
        sample = default_dataset_module.passkey_samples(tokenizer, 700, min_tokens, rng)
        assert len(sample.tokens) == 700 and sample.doc_starts[0] == 0
        ends = [*sample.doc_starts[1:], 700]
        for start, end in zip(sample.doc_starts, ends):
            doc = sample.tokens[start:end].tolist()
            assert doc[-1] == tokenizer.eos_id
            assert end - start > (min_tokens or 699)  # each document at least min_tokens + its eos
            text = tokenizer.decode(doc[:-1])
            key = text.rsplit(" ", 1)[1]
            assert text.endswith(f"The pass key is {key}") and f"The pass key is {key}. Remember it." in text
        counts.add(len(sample.doc_starts))
    assert counts == {1} if min_tokens is None else max(counts) >= 2


# --- MDS shards and loaders --------------------------------------------------------------------


def test_write_mds_and_loader_read_back_in_order(tmp_path, clean_shm):
    samples = packed_samples(40, sample_len=17)
    assert write_mds(samples, tmp_path / "mds", size_limit=1 << 10) == 40
    assert len(json.loads((tmp_path / "mds" / "index.json").read_text())["shards"]) > 1
    loader = build_loader(tmp_path / "mds", micro_batch_size=4, shuffle=False, seed=0)
    batches = list(loader)
    assert len(batches) == 10
    for b in batches:
        for key in ("input_ids", "labels", "doc_ids"):
            assert b[key].dtype == torch.int64 and b[key].shape == (4, 16)
    inputs = torch.cat([b["input_ids"] for b in batches]).numpy()
    labels = torch.cat([b["labels"] for b in batches]).numpy()
    doc_ids = torch.cat([b["doc_ids"] for b in batches]).numpy()
    tokens = np.stack([s.tokens for s in samples])
    assert (inputs == tokens[:, :-1]).all()
    assert (labels == tokens[:, 1:]).all()
    for row, s in zip(doc_ids, samples):
        want = [sum(1 for start in s.doc_starts[1:] if start <= p) for p in range(16)]
        assert row.tolist() == want


def test_write_mds_refuses_existing_dir(tmp_path):
    (tmp_path / "mds").mkdir()
    with pytest.raises(ValueError, match=str(tmp_path / "mds")):
        write_mds(packed_samples(2, 9), tmp_path / "mds")


def test_write_mds_leaves_nothing_when_samples_fail(tmp_path):
    def failing():
        yield from packed_samples(30, 33)
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        write_mds(failing(), tmp_path / "mds", size_limit=256)
    assert os.listdir(tmp_path) == []


# --- the default dataset -----------------------------------------------------------------------

# 257, not 129: with a 512-piece vocab trained on code, the passkey prompt's fixed text alone
# (instruction, needle, question) is ~150 tokens.
BUILD_ARGS = dict(
    sample_len=257,
    vocab_size=512,
    corpus_bytes=300_000,
    passkey_fraction=0.2,
    val_fraction=0.05,
    seed=1,
)


def test_build_default_dataset_and_cache(tmp_path):
    ds = build_default_dataset(tmp_path, **BUILD_ARGS)
    assert (ds.train_dir / "index.json").exists() and (ds.val_dir / "index.json").exists()
    tok = open_tokenizer(ds.tokenizer_path)
    assert tok.vocab_size == 512
    assert [p.name for p in tmp_path.iterdir()] == [ds.train_dir.parent.name]  # no temp dirs

    streaming = import_streaming()
    n_samples, n_passkey = {}, 0
    for split, path in (("train", ds.train_dir), ("val", ds.val_dir)):
        local = streaming.LocalDataset(local=str(path))
        n_samples[split] = len(local)
        for i in range(len(local)):
            sample = local[i]
            assert sample["tokens"].shape == (257,) and sample["doc_starts"][0] == 0
            text = tok.decode(sample["tokens"].tolist())
            if "What is the pass key? The pass key is" in text:
                # a passkey document is a whole sample: instruction first, its eos last, nothing else
                n_passkey += 1
                assert text.startswith("There is an important info hidden")
                assert sample["doc_starts"].tolist() == [0] and sample["tokens"][-1] == tok.eos_id
    total = n_samples["train"] + n_samples["val"]
    assert n_samples["val"] >= 1 and abs(n_samples["val"] / total - 0.05) < 0.02
    assert abs(n_passkey / total - 0.2) < 0.03

    start = time.perf_counter()
    again = build_default_dataset(tmp_path, **BUILD_ARGS)
    assert time.perf_counter() - start < 0.5
    assert again == ds
    other = build_default_dataset(tmp_path, **{**BUILD_ARGS, "seed": 2})
    assert other.train_dir != ds.train_dir


def test_build_default_dataset_loser_of_race_uses_winner(tmp_path, monkeypatch):
    real_build = default_dataset_module.write_default_dataset

    def build_while_another_wins(out, **args):
        real_build(out, **args)
        winner = out.parent / out.name.split(".tmp-")[0].lstrip(".")
        winner.mkdir()
        (winner / "marker").write_text("winner")

    monkeypatch.setattr(default_dataset_module, "write_default_dataset", build_while_another_wins)
    args = {**BUILD_ARGS, "corpus_bytes": 100_000}
    ds = build_default_dataset(tmp_path, **args)
    assert (ds.train_dir.parent / "marker").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir()] == [ds.train_dir.parent.name]


def test_streaming_imports_without_its_tokenizer_and_vision_parts():
    """streaming.text would import transformers' AutoTokenizer (and scikit-learn): ~2.4 s of every
    training process's start; streaming.base.dataloader the rest of transformers, for two classes
    megabam's dict batches never are. megabam uses streaming.base only; a later import of
    transformers gets its real classes, and one loaded before streaming is streaming's."""
    code = (
        "import sys\n"
        "from megabam.data.streaming_import import import_streaming\n"
        "s = import_streaming()\n"
        "assert s.StreamingDataset and s.MDSWriter and s.base.util.clean_stale_shared_memory\n"
        "heavy = ('transformers', 'sklearn', 'torchvision')\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "from transformers.tokenization_utils_base import BatchEncoding\n"
        "from transformers.feature_extraction_utils import BatchFeature\n"
        "print(len(BatchEncoding({'a': [1]})), len(BatchFeature({'a': [1]})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "1 1"], out.stdout

    code = (
        "from transformers.tokenization_utils_base import BatchEncoding\n"
        "from megabam.data.streaming_import import import_streaming\n"
        "import_streaming()\n"
        "import streaming.base.dataloader as d\n"
        "print(d.BatchEncoding is BatchEncoding)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "True"


def test_shared_memory_cleanup_spares_a_segment_created_during_its_scan(monkeypatch):
    """A segment another test's job creates while the cleanup reads the processes' maps (a streaming
    leader sharing an epoch, its other rank about to attach) is not the cleanup's to remove."""
    import megabam.data.shm_cleanup as shm

    new = f"/dev/shm/megabam_test_{os.getpid()}_new"
    real = shm.mapped_by_others

    def scan_while_a_job_creates_one():
        with open(new, "wb") as f:
            f.write(b"\0" * 64)
        return real()

    monkeypatch.setattr(shm, "mapped_by_others", scan_while_a_job_creates_one)
    try:
        shm.remove_stale(f"/dev/shm/megabam_test_{os.getpid()}_*")
        assert os.path.exists(new)
    finally:
        os.remove(new)


def test_shared_memory_cleanup_spares_what_another_live_process_maps():
    """megabam/data/shm_cleanup.py: two test workers clean /dev/shm without breaking each other."""
    from megabam.data.shm_cleanup import remove_stale

    held, stale = (f"/dev/shm/megabam_test_{os.getpid()}_{name}" for name in ("held", "stale"))
    for path in (held, stale):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
        os.utime(path, (time.time() - 60, time.time() - 60))  # old enough to be anyone's leftover
    code = (
        f"import mmap, sys; f = open({held!r}, 'r+b'); m = mmap.mmap(f.fileno(), 0); "
        "print('mapped', flush=True); sys.stdin.read()"
    )
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "mapped"
        remove_stale(f"/dev/shm/megabam_test_{os.getpid()}_*")
        assert os.path.exists(held) and not os.path.exists(stale)
    finally:
        other.communicate("")
        os.remove(held)


def test_shared_memory_cleanup_spares_a_young_segment_nobody_maps_yet():
    """A segment listed between its creation and its creator's mmap (shm_open, ftruncate, mmap: a job
    of the other test worker, or of a second copy of the suite, at any moment) is not stale; one as
    old, unmapped, left by a finished process is."""
    from megabam.data.shm_cleanup import MIN_AGE_S, remove_stale

    young, old = (f"/dev/shm/megabam_test_{os.getpid()}_{name}" for name in ("young", "old"))
    for path in (young, old):
        with open(path, "wb") as f:
            f.write(b"\0" * 64)
    os.utime(old, (time.time() - 2 * MIN_AGE_S, time.time() - 2 * MIN_AGE_S))
    try:
        remove_stale(f"/dev/shm/megabam_test_{os.getpid()}_*")
        assert os.path.exists(young) and not os.path.exists(old)
    finally:
        for path in (young, old):
            if os.path.exists(path):
                os.remove(path)


def test_a_dataset_takes_the_next_prefix_when_another_job_registers_between_its_scan_and_claim(
    tmp_path, clean_shm, monkeypatch
):
    """Streaming's prefix race between jobs starting together on a node (megabam/data/shm_prefix.py):
    another job creates the first free prefix's `locals` segment just after this job's scan found it
    free. Streaming's own registration then fails; megabam's takes a free prefix and reads.

    Other jobs on the machine (the suite's other worker, a second copy of the suite) register
    prefixes of their own at any moment, so the test asserts what megabam promises, not which number
    it gets: a prefix that is not the competitor's, whose `locals` segment this dataset created and
    describes this dataset, and every sample read."""
    import_streaming()
    from streaming.base.shared import SharedMemory
    from streaming.base.shared import prefix as streaming_prefix
    from streaming.base.world import World

    assert write_mds(packed_samples(8, sample_len=17), tmp_path / "mds") == 8
    scan, others = streaming_prefix._check_and_find_retrying, []

    def scan_then_another_job_registers(local, remote, shm_name, retry):
        found = scan(local, remote, shm_name, retry)
        if shm_name == "locals":  # the competitor takes the first prefix from `found` nobody holds
            for prefix in range(found, found + 1000):
                try:
                    others.append((prefix, SharedMemory(streaming_prefix._get_path(prefix, "locals"), True, 16)))
                    break
                except FileExistsError:  # a third job's (another test, another suite) since the scan
                    continue
        return found

    monkeypatch.setattr(streaming_prefix, "_check_and_find_retrying", scan_then_another_job_registers)
    try:
        with pytest.raises(FileExistsError):
            streaming_prefix.get_shm_prefix([str(tmp_path / "mds")], [None], World(1, 1, 1, 0))
        loader = build_loader(tmp_path / "mds", micro_batch_size=4, shuffle=False, seed=0)
        mine = loader.dataset._shm_prefix_int
        assert mine not in {prefix for prefix, _ in others}
        registered = SharedMemory(streaming_prefix._get_path(mine, "locals"), False)
        assert streaming_prefix._unpack_locals(bytes(registered.buf)) == ([str(tmp_path / "mds")], mine)
        assert [len(batch["input_ids"]) for batch in loader] == [4, 4]
    finally:
        for _, shm in others:
            shm.cleanup()


LEADER_EXITS = """
import glob, os, sys
from tempfile import gettempdir
from megabam.data.loader import build_loader

loader = build_loader(sys.argv[1], micro_batch_size=4, shuffle=False, seed=0)
assert [len(batch["input_ids"]) for batch in loader] == [4, 4]
prefix = loader.dataset._shm_prefix_int
print(prefix, sorted(os.path.basename(p) for p in glob.glob(os.path.join(gettempdir(), f"{prefix:06}_*"))))
"""


def test_a_dataset_leaves_no_file_locks_behind_when_its_process_exits(tmp_path):
    """Streaming's two lock files per dataset (megabam/data/shm_prefix.py) exist while the dataset
    lives and are gone after a normal exit, so later jobs' prefix scans do not grow with the node's
    history. The process gets a temporary directory of its own (TMPDIR) to look in."""
    assert write_mds(packed_samples(8, sample_len=17), tmp_path / "mds") == 8
    locks = tmp_path / "tmp"
    locks.mkdir()
    env = dict(os.environ, TMPDIR=str(locks))
    done = subprocess.run(
        [sys.executable, "-c", LEADER_EXITS, str(tmp_path / "mds")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    prefix, during = done.stdout.split(" ", 1)
    assert during.strip() == str([f"{int(prefix):06}_barrier_filelock", f"{int(prefix):06}_cache_filelock"])
    assert [p.name for p in locks.iterdir() if p.name.endswith("_filelock")] == []
