"""Peak bytes of live tensors on CPU, where torch keeps no allocator statistics: a dispatch mode that
counts every storage an operator creates until it is freed, on top of the storages that exist when
it starts (the weights, gradients and optimizer state it is given)."""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensors(TorchDispatchMode):
    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.known: set[int] = set()  # data pointers of the storages counted (or there before)
        self.live = 0
        for t in existing:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.known:
                self.known.add(storage.data_ptr())
                self.live += storage.nbytes()
        self.peak = self.live

    def _freed(self, key: int, nbytes: int) -> None:
        self.known.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in self.known or key in inputs:  # empty, counted, in place or a view
                continue
            self.known.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out
