"""Peak bytes of live tensor storages, where no allocator keeps statistics: a real step on
CPU, and a step run on FakeTensors (memory.estimate_peak), which allocate nothing.

Every storage an op creates (forward, backward, optimizer, communication buffers) is counted
from the moment it appears until Python's last reference to it goes, each storage once
however many views share it; tensors given as resident count from the start. This is what
torch's MemTracker does for storages, but MemTracker also hooks every module and refuses a
module called more than once per step, which is how a pipeline stage runs its microbatches.

Storages made by host work (host_tier.on_host: an optimizer step kept on the host) are the
host's, not counted.

Each storage is counted in a category (what `where()` says when it appears); the bytes by
category at the peak and, with `timeline=True`, the live bytes after every change are kept.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .host_tier import host_work
from .planning_device import planning_device


CUDA_BLOCK = 512


# What a step's timeline counts before its first op: analysis/memory.py's categories, LiveStorage's default last
RESIDENT_EVENTS = ("parameters", "parameter gradients", "buffers", "inputs", "optimizer state", "resident")


def from_first_op(timeline: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """A step's timeline from its first op on: the resident storages counted in one first event,
    "resident", at their total, not drawn as a climb from zero."""
    k = next((i for i, (event, _) in enumerate(timeline) if event not in RESIDENT_EVENTS), len(timeline))
    return [("resident", timeline[k - 1][1] if k else 0)] + timeline[k:]


@dataclass
class Stored:
    """One storage of a step, with timeline=True: positions are counts of changes before it."""
    nbytes: int
    made_at: int
    gone_at: int | None   # None: still live
    event: str            # where() said, when it appeared
    op: object            # the op whose output it is; None for one added from outside


class LiveStorage(TorchDispatchMode):
    """with LiveStorage(resident) as live: ...; live.peak is the most bytes live at once."""

    def __init__(self, resident=(), category: str = "resident", timeline: bool = False):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.by_category: dict[str, int] = {}
        self.at_peak: dict[str, int] = {}
        self.timeline: list[tuple[str, int]] | None = [] if timeline else None
        self.changes = 0  # storages counted in or out so far: a position in the step
        # with timeline, every storage; _serial maps a live storage to its index there
        self.storages: list[Stored] | None = [] if timeline else None
        self._serial: dict[int, int] = {}
        self._seen: dict[int, tuple[str, int]] = {}  # storage -> (category, bytes)
        self._op = None  # the op whose outputs are being counted
        self.add(resident, category)

    def where(self) -> tuple[str, str]:
        """(category, event) of storages appearing now."""
        return "allocated", ""

    def add(self, tensors, category: str, event: str | None = None) -> None:
        """Count tensors made outside the tracked code (resident ones) in `category`."""
        for t in tensors:
            self._add(t, category, event or category)

    def add_bytes(self, category: str, nbytes: int, event: str) -> None:
        """Bytes held for the whole step that no tensor here stands for (optimizer state)."""
        self._change(category, nbytes, event)

    def recategorize(self, t: torch.Tensor, category: str) -> None:
        """Count t's storage in another category from now (a gradient that became a .grad)."""
        key = _key(t)
        if key in self._seen:
            old, nbytes = self._seen[key]
            self._seen[key] = (category, nbytes)
            self.by_category[old] -= nbytes
            self.by_category[category] = self.by_category.get(category, 0) + nbytes

    def _add(self, t: torch.Tensor, category: str, event: str, nbytes: int | None = None) -> None:
        if (t.device.type == "meta" and not isinstance(t, FakeTensor)) or not hasattr(t, "untyped_storage"):
            return  # a real meta tensor has no memory; a fake one stands for the model it was made from
        key = _key(t)
        if key is None or key in self._seen:
            return
        nbytes = t.untyped_storage().nbytes() if nbytes is None else nbytes
        if nbytes and (t.device.type == "cuda" or planning_device() == "cuda"):
            # a fake on CUDA, or one planned for it: its allocator hands out 512-byte blocks
            nbytes = -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK
        if nbytes == 0:
            return
        self._seen[key] = (category, nbytes)
        if self.storages is not None:
            self._serial[key] = len(self.storages)
            self.storages.append(Stored(nbytes, self.changes, None, event, self._op))
        self._change(category, nbytes, event)
        weakref.finalize(t.untyped_storage(), self._free, key)

    def serial(self, t: torch.Tensor) -> int | None:
        """The index in `storages` of t's storage, while it is live and counted."""
        return self._serial.get(_key(t))

    def _free(self, key: int) -> None:
        if key in self._seen:
            category, nbytes = self._seen.pop(key)
            if self.storages is not None:
                self.storages[self._serial.pop(key)].gone_at = self.changes
            self._change(category, -nbytes, "free")

    def _change(self, category: str, nbytes: int, event: str) -> None:
        self.changes += 1
        self.live += nbytes
        self.by_category[category] = self.by_category.get(category, 0) + nbytes
        if self.timeline is not None:
            self.timeline.append((event, self.live))
        if self.live > self.peak:
            self.peak, self.at_peak = self.live, {k: v for k, v in self.by_category.items() if v}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)] if not host_work() else []
        if tensors:
            category, event = self.where()
            sizes = self.sizes(func, args, kwargs or {}, tensors)
            self._op = func
            for t, nbytes in zip(tensors, sizes):
                self._add(t, category, event, nbytes)
            self._op = None
        return out

    def sizes(self, func, args, kwargs, out: list[torch.Tensor]) -> list[int | None]:
        """Bytes each output of func occupies; None: its storage's own size."""
        return [None] * len(out)


def _key(t: torch.Tensor) -> int | None:
    """Identity of t's storage: its address, or for a FakeTensor's (meta, no address) the
    storage object, which lives as long as the storage does."""
    try:
        storage = t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # tensor subclasses without one storage
        return None
    return id(storage) if storage.device.type == "meta" else storage.data_ptr() or id(storage)
