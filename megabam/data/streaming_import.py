"""The one place megabam imports mosaicml-streaming."""

import contextlib
import importlib
import sys
import types


def import_streaming() -> types.ModuleType:
    """Return the ``streaming`` module, importable without a working torchvision.

    ``streaming/__init__.py`` eagerly imports ``streaming.vision`` and ``streaming.multimodal``,
    which import torchvision, and ``streaming.text``, which imports transformers' AutoTokenizer
    (and with it scikit-learn and torch.distributed.tensor: measured 3.3–3.9 s → 1.1 s of every
    training process's start). On the CPU stack torchvision is absent, or installed but unable to
    load beside CPU torch, so ``import streaming`` would fail. megabam uses only ``streaming.base``
    (the dataset, the MDS writer), so empty stand-ins for the three are registered before the first
    import. The dataset's shared-memory prefix is registered by megabam/data/shm_prefix.py.
    """
    if "streaming" not in sys.modules:
        for name in ("streaming.vision", "streaming.multimodal", "streaming.text"):
            sys.modules.setdefault(name, types.ModuleType(name))
        with _batch_types_without_transformers():
            importlib.import_module("streaming")
    import streaming
    import streaming.base.dataset

    from megabam.data import shm_prefix

    streaming.base.dataset.get_shm_prefix = shm_prefix.get_shm_prefix  # its racy original: shm_prefix.py
    return streaming


@contextlib.contextmanager
def _batch_types_without_transformers():
    """``streaming.base.dataloader`` imports transformers for two classes it only tests batches
    against, after ``dict``: megabam's batches are dicts. Importing it cost every training process
    0.6–1.0 s of CPU at its start (a 2-step run: 4.0–4.6 s of user time, 3.5 s without). Unless
    transformers is loaded already, the import sees two stand-in modules holding empty classes of
    those names, removed from ``sys.modules`` right after, so a later ``import transformers`` (the
    export, Hugging Face tokenizers) loads the real ones."""
    names = {
        "transformers.feature_extraction_utils": "BatchFeature",
        "transformers.tokenization_utils_base": "BatchEncoding",
    }
    if "transformers" in sys.modules:
        yield
        return
    for module, cls in names.items():
        stand_in = types.ModuleType(module)
        setattr(stand_in, cls, type(cls, (), {}))
        sys.modules[module] = stand_in
    try:
        yield
    finally:
        for module in names:
            del sys.modules[module]
