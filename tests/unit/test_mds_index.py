"""index.json of an MDS dataset is checked before any shard is read: its shape, the MDS format, shard
names inside the dataset, and column encodings megabam decodes (every other one is refused)."""

import json

import pytest

from megabam.cli import main
from megabam.data.errors import DataError
from megabam.data.shards import is_safe_encoding, read_index


def shard(**change):
    entry = {
        "format": "mds",
        "column_names": ["tokens", "doc_starts"],
        "column_encodings": ["ndarray:int32", "ndarray:int32"],
        "raw_data": {"basename": "shard.00000.mds", "bytes": 100, "hashes": {}},
        "zip_data": None,
        "samples": 3,
    }
    entry.update(change)
    return entry


@pytest.mark.parametrize(
    "index, message",
    [
        ([1, 2], "not an MDS index"),
        ({"shards": {}}, "not an MDS index"),
        ({"shards": [7]}, "shard 0: format 'int' is not MDS"),
        ({"shards": [shard(format="json")]}, "shard 0: format 'json' is not MDS"),
        ({"shards": [shard(raw_data=None)]}, "shard 0: malformed entry"),
        ({"shards": [shard(), shard(samples="3")]}, "shard 1: malformed entry"),
        ({"shards": [shard(column_names=["tokens"])]}, "shard 0: malformed entry"),
        ({"shards": [shard(raw_data={"basename": "../x.mds", "bytes": 1})]}, "points outside the dataset"),
        ({"shards": [shard(column_encodings=["ndarray:int32", "pkl"])]}, "column 'doc_starts' has encoding 'pkl'"),
        ({"shards": [shard(column_encodings=["jpeg", "str"])]}, "column 'tokens' has encoding 'jpeg'"),
    ],
)
def test_bad_index_is_one_line_naming_the_file(tmp_path, capsys, index, message):
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match=message):
        read_index(tmp_path)
    assert main(["data", "inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"megabam: error: {tmp_path / 'index.json'}: ") and message in err[0]


def test_the_encodings_megabam_writes_and_reads_are_allowed():
    for encoding in ["ndarray", "ndarray:int32", "ndarray:uint16:4,4", "str", "bytes", "json", "int64", "float32"]:
        assert is_safe_encoding(encoding), encoding
    for encoding in ["pkl", "pil", "png", "jpeg", "list[pil]", "jpeg_array"]:
        assert not is_safe_encoding(encoding), encoding
