"""The one place megabam imports mosaicml-streaming."""

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
    import streaming
    import streaming.base.dataset

    from megabam.data import shm_prefix

    streaming.base.dataset.get_shm_prefix = shm_prefix.get_shm_prefix  # its racy original: shm_prefix.py
    return streaming
