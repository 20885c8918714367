"""A crafted MDS dataset cannot run code: every path that reads shards megabam did not write
(`data inspect`, `data prepare` on MDS input, training streams, remote streams) refuses a column
whose encoding would unpickle, naming the file and the column, before any sample is decoded."""

import os
import subprocess
import sys

import pytest

from megabam.data.corpus import python_stdlib_documents
from megabam.data.errors import DataError
from megabam.data.loader import build_loader
from megabam.data.mixture import StreamSpec
from megabam.data.streaming_import import import_streaming
from megabam.data.tokenizer import train_tokenizer

pytestmark = pytest.mark.usefixtures("clean_shm")


class RunsCode:
    """Pickled as a call of os.system: unpickling it creates `path`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.fixture
def crafted(tmp_path):
    """(dataset directory, marker path): a `pkl` text column next to megabam's own token columns."""
    marker = tmp_path / "pwned"
    streaming = import_streaming()
    out = tmp_path / "crafted"
    columns = {"tokens": "ndarray:int32", "doc_starts": "ndarray:int32", "text": "pkl"}
    import numpy as np

    with streaming.MDSWriter(out=str(out), columns=columns) as writer:
        for _ in range(4):
            writer.write(
                {"tokens": np.arange(9, dtype=np.int32), "doc_starts": np.zeros(1, np.int32), "text": RunsCode(marker)}
            )
    return out, marker


def test_the_crafted_dataset_really_runs_code_when_decoded(crafted, tmp_path):
    """The control: streaming's own reader, without megabam's check, executes the payload."""
    out, marker = crafted
    import json

    from streaming.base.format import reader_from_json

    shard = json.loads((out / "index.json").read_text())["shards"][0]
    reader_from_json(str(out), None, shard).get_item(0)
    assert marker.exists()


def _megabam(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megabam.cli", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def _one_line_refusal(result: subprocess.CompletedProcess, dataset) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megabam: error: {dataset / 'index.json'}: shard 0")
    assert "column 'text' has encoding 'pkl'" in lines[0]


def test_inspect_refuses_it(crafted):
    out, marker = crafted
    _one_line_refusal(_megabam("data", "inspect", out), out)
    assert not marker.exists()


def test_prepare_refuses_it_as_input(crafted, tmp_path):
    out, marker = crafted
    tok = tmp_path / "tok.model"
    train_tokenizer(python_stdlib_documents(100_000), tok, vocab_size=512)
    result = _megabam(
        "data", "prepare", out, "--out", tmp_path / "prepared", "--tokenizer", tok, "--seq-len", 8, "--field", "text"
    )
    _one_line_refusal(result, out)
    assert not marker.exists() and not (tmp_path / "prepared").exists()


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_training_streams_refuse_it(crafted, tmp_path, remote):
    out, marker = crafted
    stream = StreamSpec(str(tmp_path / "cache"), remote=str(out)) if remote else StreamSpec(str(out))
    with pytest.raises(DataError, match="column 'text' has encoding 'pkl'"):
        loader = build_loader([stream], micro_batch_size=2, shuffle=False, seed=0)
        next(iter(loader))
    assert not marker.exists()
