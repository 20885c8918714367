"""`megabam data prepare` in tasks: any number of workers, or shards on several nodes merged, gives the
same dataset sample for sample; parts from another plan or tokenizer are refused; progress in bytes."""

import json
import random

import pytest
from helpers.prepared import prepared_samples

import megabam.progress
from megabam.cli import main
from megabam.data.corpus import python_stdlib_documents
from megabam.data.prepare import prepare_dataset
from megabam.data.tokenizer import open_tokenizer, train_tokenizer

TASK = 18_000  # --task-size: tasks of one or two files
WORDS = ["alpha", "beta", "gamma", "delta", "x = 12", "def f():", "ünïcode", "\n", "    return"]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "sp.model"
    train_tokenizer(python_stdlib_documents(300_000), path, vocab_size=512)
    return path


@pytest.fixture
def corpus(tmp_path):
    """Seven JSON Lines files of ~4-12 KB."""
    rng = random.Random(21)
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(7):
        docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 50))) for _ in range(rng.randrange(30, 60))]
        (folder / f"part{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return folder


def prepare(capsys, corpus, out, tok_path, *extra):
    cmd = ["data", "prepare", corpus, "--out", out, "--tokenizer", tok_path, "--seq-len", 31]
    cmd += ["--val-fraction", 0.2, "--task-size", TASK, "--no-progress", *extra]
    code = main([str(a) for a in cmd])
    out_text, err = capsys.readouterr()
    return code, out_text, err


def task_files(corpus):
    """The inputs cut into tasks as the module documents: consecutive files of at most TASK bytes."""
    tasks, size = [], 0
    for f in sorted(corpus.iterdir()):
        if tasks and size + f.stat().st_size <= TASK:
            tasks[-1].append(f)
            size += f.stat().st_size
        else:
            tasks.append([f])
            size = f.stat().st_size
    return tasks


def expected_samples(corpus, tok_path):
    """The reference for a corpus of files under TASK bytes."""
    tasks = [
        [json.loads(line)["text"] for f in task for line in f.read_text().splitlines()] for task in task_files(corpus)
    ]
    return samples_of_tasks(tasks, tok_path)


def samples_of_tasks(tasks, tok_path):
    """Each task (its documents in order) a stream of documents split by random.Random("SEED/TASK"),
    eos after each, cut into 32-token samples; the tasks' samples in task order."""
    tok = open_tokenizer(tok_path)
    expected = {"train": [], "val": []}
    for t, texts in enumerate(tasks):
        rng, streams = random.Random(f"0/{t}"), {"train": [], "val": []}
        for text in texts:
            streams["val" if rng.random() < 0.2 else "train"].append(tok.encode(text))
        for split, docs in streams.items():
            flat, begins = [], []
            for ids in docs:
                begins.append(len(flat))
                flat += ids + [tok.eos_id]
            for i in range(len(flat) // 32):
                starts = sorted({0} | {b - 32 * i for b in begins if 32 * i <= b < 32 * (i + 1)})
                expected[split].append((flat[32 * i : 32 * (i + 1)], starts))
    return expected


def test_workers_and_shards_give_the_same_dataset_sample_for_sample(tmp_path, corpus, tok_path, capsys):
    """0, 1 and 2 workers, and two shards (the second merging), write the same samples in the same order;
    each task's documents are packed as one stream (the reference), tasks in order."""
    for name, extra in [("w0", ["--workers", 0]), ("w1", ["--workers", 1]), ("w2", ["--workers", 2])]:
        code, out, err = prepare(capsys, corpus, tmp_path / name, tok_path, *extra)
        assert code == 0, err
    reference = prepared_samples(tmp_path / "w0")
    assert prepared_samples(tmp_path / "w1") == prepared_samples(tmp_path / "w2") == reference
    n = len(task_files(corpus))
    assert n >= 4 and any(len(task) > 1 for task in task_files(corpus))
    assert json.loads((tmp_path / "w2" / "meta.json").read_text())["tasks"] == n
    assert sorted(p.name for p in (tmp_path / "w2").iterdir()) == ["meta.json", "tokenizer.model", "train", "val"]
    parts = sorted(p.name for p in (tmp_path / "w2" / "train").iterdir())
    assert parts == [f"{t:06d}" for t in range(n)] + ["index.json"]

    # Two shards on "two nodes": the first leaves its part, holding only its own tasks; the second merges.
    code, out, err = prepare(capsys, corpus, tmp_path / "s", tok_path, "--num-shards", 2, "--shard-index", 1)
    odd = list(range(1, n, 2))
    assert code == 0 and f"{len(odd)} of {n} tasks done; the other parts are still running" in out, err
    staging = tmp_path / ".s.prepare"
    assert sorted(p.name for p in (staging / "train").iterdir()) == [f"{t:06d}" for t in odd]
    assert not (tmp_path / "s").exists()
    code, _, err = run_merge(capsys, tmp_path / "s")
    assert code == 2 and f"{n - len(odd)} of {n} tasks are not done (first: 0)" in err
    code, out, err = prepare(capsys, corpus, tmp_path / "s", tok_path, "--num-shards", 2, "--shard-index", 0)
    assert code == 0 and out.startswith(f"prepared {tmp_path / 's'}"), err
    assert prepared_samples(tmp_path / "s") == reference and not staging.exists()

    assert reference == expected_samples(corpus, tok_path)


def test_a_file_larger_than_a_task_is_cut_into_pieces_the_workers_share(tmp_path, tok_path, capsys):
    """One JSON Lines file of ~5 tasks: piece k of n holds the lines that begin in its n-th of the bytes,
    a task each, the same dataset for 0 and 2 workers."""
    rng = random.Random(5)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 60))) for _ in range(400)]
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    data, size = big.read_bytes(), big.stat().st_size
    n = -(-size // TASK)
    assert n >= 4
    starts = [0] + [i + 1 for i, byte in enumerate(data[:-1]) if byte == ord("\n")]
    tasks = [[t for t, b in zip(texts, starts) if size * k // n <= b < size * (k + 1) // n] for k in range(n)]
    assert sum(map(len, tasks)) == len(texts) and all(tasks)
    for name, workers in [("w0", 0), ("w2", 2)]:
        code, out, err = prepare(capsys, big, tmp_path / name, tok_path, "--workers", workers)
        assert code == 0 and f"documents        {len(texts)} " in out, err
        assert json.loads((tmp_path / name / "meta.json").read_text())["tasks"] == n
    assert prepared_samples(tmp_path / "w0") == prepared_samples(tmp_path / "w2") == samples_of_tasks(tasks, tok_path)


def run_merge(capsys, out):
    code = main(["data", "merge", str(out)])
    out_text, err = capsys.readouterr()
    return code, out_text, err


def test_a_part_from_another_plan_or_tokenizer_is_refused(tmp_path, corpus, tok_path, capsys):
    code, _, err = prepare(capsys, corpus, tmp_path / "s", tok_path, "--num-shards", 2, "--shard-index", 0)
    assert code == 0, err
    staging = tmp_path / ".s.prepare"
    plan = (staging / "plan.json").read_text()
    other = tmp_path / "other.model"
    train_tokenizer(python_stdlib_documents(200_000), other, vocab_size=400)
    code, _, err = prepare(capsys, corpus, tmp_path / "s", other, "--num-shards", 2, "--shard-index", 1)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "an unfinished prepare of other tokenizer is there" in lines[0]
    assert (staging / "plan.json").read_text() == plan  # the other prepare's work untouched
    # A part whose record names another tokenizer (copied in from another prepare) is refused at the merge.
    code, _, err = prepare(capsys, corpus, tmp_path / "s", tok_path, "--num-shards", 2, "--shard-index", 1)
    assert code == 0, err  # merged: now make a second prepare and tamper with one of its parts
    code, _, err = prepare(capsys, corpus, tmp_path / "t", tok_path, "--num-shards", 2, "--shard-index", 0)
    assert code == 0, err
    marker = tmp_path / ".t.prepare" / "done" / "000000.json"
    record = json.loads(marker.read_text())
    marker.write_text(json.dumps({**record, "tokenizer_sha1": "0" * 40}))
    code, _, err = prepare(capsys, corpus, tmp_path / "t", tok_path, "--num-shards", 2, "--shard-index", 1)
    assert code == 2 and "task 0 was tokenized with another tokenizer than the plan's" in err
    assert (tmp_path / ".t.prepare" / "plan.json").is_file() and not (tmp_path / "t").exists()


def test_progress_is_bytes_of_the_total_with_an_eta_off_a_terminal(tmp_path, corpus, tok_path, capsys, monkeypatch):
    monkeypatch.setattr(megabam.progress, "LINE_EVERY_S", 0.0)
    total = sum(f.stat().st_size for f in corpus.iterdir())
    prepare_dataset([str(corpus)], tmp_path / "o", tok_path, 31, workers=0, task_bytes=5000, progress=True)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("prepare: ")]
    # One per piece finished: a file over 5,000 bytes is read in pieces of at most that.
    assert len(lines) == sum(-(-f.stat().st_size // 5000) for f in corpus.iterdir()) > len(list(corpus.iterdir()))
    amount = f"{total / 2**10:.1f}KiB" if total < 2**20 else f"{total / 2**20:.1f}MiB"
    assert lines[-1].startswith(f"prepare: {amount} of {amount} (100%), ")
    assert all("B/s, ETA " in x for x in lines)
