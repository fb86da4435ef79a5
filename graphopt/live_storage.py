"""Peak bytes of live tensor storages on CPU, where no allocator keeps statistics.

Every storage an op creates (forward, backward, optimizer, communication buffers) is counted
from the moment it appears until Python's last reference to it goes, each storage once
however many views share it; tensors given as resident count from the start. This is what
torch's MemTracker does for storages, but MemTracker also hooks every module and refuses a
module called more than once per step, which is how a pipeline stage runs its microbatches.
"""
from __future__ import annotations

import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveStorage(TorchDispatchMode):
    """with LiveStorage(resident) as live: ...; live.peak is the most bytes live at once."""

    def __init__(self, resident=()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        for t in resident:
            self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or not hasattr(t, "untyped_storage"):
            return
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # tensor subclasses without one storage
            return
        key = storage.data_ptr() or id(storage)
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        if key in self._seen:
            self._seen.discard(key)
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out
