"""The one place megabam imports mosaicml-streaming."""

import sys
import types


def import_streaming() -> types.ModuleType:
    """Return the ``streaming`` module, importable without a working torchvision.

    ``streaming/__init__.py`` eagerly imports ``streaming.vision`` and ``streaming.multimodal``,
    which import torchvision. On the CPU stack torchvision is absent, or installed but unable to
    load beside CPU torch, so ``import streaming`` would fail although megabam uses neither
    subpackage. In that case empty stand-ins for the two are registered before the first import.
    """
    if "streaming" not in sys.modules:
        try:
            import torchvision  # noqa: F401
        except Exception:  # absent, or broken ("operator torchvision::nms does not exist")
            for name in ("streaming.vision", "streaming.multimodal"):
                sys.modules.setdefault(name, types.ModuleType(name))
    import streaming

    return streaming
