"""Progress (megabam/progress.py) and the commands that report it: a line "DESC: X of Y (P%), R/s, ETA T"
every LINE_EVERY_S off a terminal (0 here: one per advance), a tqdm bar on one, nothing in quiet mode
(`--quiet` on any command, MEGABAM_QUIET=1); always on stderr, the results on stdout the same either way."""

import io
import json
import re

import pytest
from helpers.checkpoints import write_run
from safetensors import safe_open

import megabam.progress
from megabam.cli import main
from megabam.data.prepare import prepare_dataset
from megabam.data.shards import read_index
from megabam.progress import Progress, set_quiet


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def loud(monkeypatch):
    """Not quiet, and quiet mode reset after each test; a line at every advance off a terminal."""
    monkeypatch.delenv("MEGABAM_QUIET", raising=False)
    monkeypatch.setattr(megabam.progress, "_quiet", False)
    monkeypatch.setattr(megabam.progress, "LINE_EVERY_S", 0.0)


def amount(n: float, binary: bool = False) -> str:
    return Progress("", None, binary=binary, enabled=False)._amount(n)


def test_lines_off_a_terminal_give_done_total_share_rate_and_eta():
    stream = io.StringIO()
    with Progress("copy", 4 * 2**20, "B", binary=True, stream=stream) as p:
        for _ in range(4):
            p.advance(2**20)
    lines = stream.getvalue().splitlines()
    assert [x.split(",")[0] for x in lines] == [
        "copy: 1.0MiB of 4.0MiB (25%)",
        "copy: 2.0MiB of 4.0MiB (50%)",
        "copy: 3.0MiB of 4.0MiB (75%)",
        "copy: 4.0MiB of 4.0MiB (100%)",
    ]
    assert all(
        re.fullmatch(r"copy: .* \(\d+%\), [\d.]+[KMG]?i?B/s, ETA (\d+ s|[\d.]+ min|[\d.]+ h|\?)", x) for x in lines
    )
    assert lines[-1].endswith("ETA 0 s")


def test_a_log_that_showed_progress_ends_on_the_final_amount(monkeypatch):
    """Lines every LINE_EVERY_S: the work may end between two of them; closing writes where it ended,
    unless nothing was shown yet (short work stays silent) or the work failed."""
    stream = io.StringIO()
    monkeypatch.setattr(megabam.progress, "LINE_EVERY_S", 3600.0)
    with Progress("short", 10, stream=stream) as p:
        p.advance(10)
    assert stream.getvalue() == ""
    with Progress("long", 10, stream=stream) as p:
        p.last_line -= 3600  # the first advance comes a period after the start
        p.advance(4)
        p.advance(6)
    assert [x.split(" (")[0] for x in stream.getvalue().splitlines()] == ["long: 4 of 10", "long: 10 of 10"]
    with pytest.raises(RuntimeError), Progress("failed", 10, stream=stream) as p:
        p.last_line -= 3600
        p.advance(4)
        raise RuntimeError
    assert stream.getvalue().splitlines()[-1].startswith("failed: 4 of 10")


def test_without_a_total_the_amount_and_rate_only():
    stream = io.StringIO()
    p = Progress("reading", None, " lines", stream=stream)
    list(p.iterate(range(1500)))
    p.close()
    assert re.fullmatch(r"reading: 1\.5k lines, [\d.]+[kMG]? lines/s", stream.getvalue().splitlines()[-1])


def test_quiet_mode_writes_nothing(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setenv("MEGABAM_QUIET", "1")
    for s in (stream, Terminal()):
        with Progress("x", 10, stream=s) as p:
            p.advance(10)
            p.note("news")
        megabam.progress.note("news", stream=s)
        assert s.getvalue() == ""
    monkeypatch.delenv("MEGABAM_QUIET")
    set_quiet(True)  # the fixture puts _quiet and MEGABAM_QUIET back
    with Progress("x", 10, stream=stream) as p:
        p.advance(10)
    assert stream.getvalue() == ""
    with Progress("x", 10, stream=stream, enabled=False) as p:  # a command's own switch (--no-progress)
        p.advance(10)
    assert stream.getvalue() == ""


def test_a_terminal_gets_a_tqdm_bar():
    term = Terminal()
    with Progress("copy", 3 * 2**20, "B", binary=True, stream=term) as p:
        assert p.bar is not None
        p.advance(3 * 2**20)
        p.note("a row of results")
    text = term.getvalue()
    assert "copy: 100%" in text and "3.00M/3.00M" in text and "a row of results" in text
    assert "(100%)" not in text  # the bar, not the lines


# --- commands ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run, _ = write_run(tmp_path_factory.mktemp("progress") / "run", "parallel.tensor=2")
    return run


def cli(capsys, *args) -> tuple[str, str]:
    assert main([str(a) for a in args]) == 0
    return capsys.readouterr()


def without_times(text: str) -> str:
    return re.sub(r"in \d+\.\d s", "in T s", text)


def test_convert_consolidate_counts_the_bytes_of_the_tensors_written(run, tmp_path, capsys):
    out, err = cli(capsys, "convert", "consolidate", run, tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        sizes = [f.get_tensor(k).nbytes for k in f.keys()]
    lines = err.splitlines()  # one per tensor written
    assert len(lines) == len(sizes) and all(x.startswith("consolidate: ") for x in lines), err
    total = amount(sum(sizes), binary=True)
    assert lines[-1].startswith(f"consolidate: {total}B of {total}B (100%), "), err
    quiet_out, quiet_err = cli(capsys, "convert", "consolidate", run, tmp_path / "out", "--overwrite", "--quiet")
    assert quiet_err == ""
    assert without_times(quiet_out) == without_times(out)


@pytest.fixture(scope="module")
def dataset(run, tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "c.jsonl").write_text(
        "".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(300))
    )
    prepare_dataset(
        [str(root / "c.jsonl")], root / "ds", run / "tokenizer.model", 15, workers=0, val_fraction=0.2, size_limit=600
    )
    return root / "ds"


def test_data_inspect_counts_shard_bytes_verified_then_samples_read(dataset, capsys):
    out, err = cli(capsys, "data", "inspect", dataset)
    for split in ("train", "val"):
        shards = read_index(dataset / split)["shards"]
        assert len(shards) > 1
        size = amount(sum((s["zip_data"] or s["raw_data"])["bytes"] for s in shards), True)
        samples = amount(sum(s["samples"] for s in shards))
        verifying = [x for x in err.splitlines() if x.startswith(f"inspect {split}: verifying: ")]
        reading = [x for x in err.splitlines() if x.startswith(f"inspect {split}: reading: ")]
        assert len(verifying) == len(shards) and verifying[-1].startswith(
            f"inspect {split}: verifying: {size}B of {size}B (100%), "
        ), err
        assert reading[-1].startswith(f"inspect {split}: reading: {samples} samples of {samples} samples (100%), ")
    quiet_out, quiet_err = cli(capsys, "data", "inspect", dataset, "--quiet")
    assert quiet_err == "" and quiet_out == out


def test_data_synth_counts_the_samples_written(run, tmp_path, capsys):
    args = ["data", "synth", "passkey", "--tokenizer", run / "tokenizer.model", "--seq-len", 255]
    out, err = cli(capsys, *args, "--out", tmp_path / "pk", "--train", 5, "--val", 2)
    lines = err.splitlines()
    assert len(lines) == 7 and lines[-1].startswith("synth: 7 samples of 7 samples (100%), "), err
    quiet_out, quiet_err = cli(capsys, *args, "--out", tmp_path / "pk", "--train", 5, "--val", 2, "--overwrite", "-q")
    assert quiet_err == "" and quiet_out == out


def test_data_tokenizer_reports_lines_read(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("".join(f"line {i} of some text, x = {i * 7}\n" for i in range(2000)))
    args = ["data", "tokenizer", tmp_path / "c.txt", "--out", tmp_path / "t.model", "--vocab-size", 300]
    out, err = cli(capsys, *args)
    assert err.splitlines()[-1].startswith("tokenizer: reading: 2.0k lines, "), err
    quiet_out, quiet_err = cli(capsys, *args, "--overwrite", "--quiet")
    assert quiet_err == "" and quiet_out == out
