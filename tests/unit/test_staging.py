"""megabam/staging.py: an output appears whole or not at all, under the one staged form that clean-up
recognises; a kill (a real SIGKILL of the writing process) leaves only a hidden staged sibling."""

import signal
import subprocess
import sys

import pytest

from megabam.staging import OutputError, check_output, is_staged, staged_folder, staged_path, write_json


def test_a_file_appears_whole_or_the_old_one_stays(tmp_path):
    out = tmp_path / "deep" / "result.json"
    write_json(out, {"a": 1})
    assert out.read_text() == '{\n "a": 1\n}\n'
    with pytest.raises(RuntimeError), staged_path(out) as tmp:
        tmp.write_text("half")
        raise RuntimeError("failed while writing")
    assert out.read_text() == '{\n "a": 1\n}\n' and sorted(p.name for p in out.parent.iterdir()) == ["result.json"]


def test_a_folder_appears_whole_replaces_only_when_asked(tmp_path):
    out = tmp_path / "ds"
    with staged_folder(out) as tmp:
        (tmp / "a").write_text("1")
        assert not out.exists() and is_staged(tmp)
    assert (out / "a").read_text() == "1"
    with pytest.raises(OutputError, match="appeared while this output was being written"), staged_folder(out) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["a"]
    with staged_folder(out, replace=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no staged or old copy left


def test_a_killed_writer_leaves_only_a_staged_sibling(tmp_path):
    out = tmp_path / "ds"
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from megabam.staging import staged_folder\n"
        "with staged_folder(Path(sys.argv[1])) as tmp:\n"
        "    (tmp / 'part').write_text('x')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(out)], timeout=60)
    assert result.returncode == -signal.SIGKILL
    (left,) = tmp_path.iterdir()
    assert not out.exists() and is_staged(left) and left.name.startswith(".ds.tmp-")
    assert not is_staged(out) and not is_staged(tmp_path / ".ds.tmp-xyz")


def test_outputs_that_exist_are_files_or_overlap_the_input_are_refused(tmp_path):
    source = tmp_path / "run"
    (source / "ckpt").mkdir(parents=True)
    for out in (source, source / "ckpt" / "out", tmp_path):
        with pytest.raises(OutputError, match="must lie outside the input"):
            check_output(out, overwrite=True, source=source / "ckpt")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="already exists"):
        check_output(tmp_path / "file", overwrite=False)
    with pytest.raises(OutputError, match="exists and is not a folder"):
        check_output(tmp_path / "file", overwrite=True)
    check_output(tmp_path / "new", overwrite=False)
    assert not (tmp_path / "new").exists()  # checked, not created
