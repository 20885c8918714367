"""Test-wide environment: CPU DeepSpeed, offline wandb, a per-session data cache, clean /dev/shm.

tests/unit: single process, fast (`pytest tests/unit` while developing); tests/e2e: several processes,
the CLI, kills and resumes; tests/helpers: what both share (not tests).
"""

import glob
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402


@pytest.fixture
def clean_shm():
    """Streaming keeps per-dataset state in /dev/shm; remove what a test leaves behind."""
    from megabam.data.streaming_import import import_streaming

    clean = import_streaming().base.util.clean_stale_shared_memory
    clean()
    yield
    clean()


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One default-dataset cache shared by every training test of the session."""
    return tmp_path_factory.mktemp("megabam_cache")


@pytest.fixture(autouse=True, scope="session")
def _remove_deepspeed_shm_buffers():
    """DeepSpeed's CPU all-reduce leaves a shared-memory buffer per rank and port; remove ours."""
    before = set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))
    yield
    for path in set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*")) - before:
        os.remove(path)
