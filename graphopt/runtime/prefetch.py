"""Batches copied to the device ahead of the step that reads them (graphopt.prefetch).

    for x, y in graphopt.prefetch(loader, "cuda", depth=2):   # x, y already on the device
        loss = opt(x, labels=y).loss; loss.backward(); optimizer.step()

On CUDA each batch's host tensors are pinned (where the loader did not: DataLoader(pin_memory=True)
pins in its workers, which is cheaper) and copied with non_blocking=True on a side stream, `depth`
batches ahead, so the copy of the next batches runs while the step computes. Before a batch is
handed out, the step's stream waits for its copy, and each of its tensors is marked used there
(record_stream), so the allocator does not give its memory to the side stream's next copy while
the step still reads it. On other devices the copy is `.to(device)` and nothing overlaps: the
same loop, the same interface.

The `depth` batches held ahead are device memory beside the step's: optimize(..., prefetch=depth)
keeps room for them in budget_gb (recompute's reserve).

A batch is what the loader yields: a tensor, or tuples, lists, namedtuples and mappings of them
(a dict, transformers' BatchEncoding); anything else in it is handed out as it is. Written by hand
because torch's own movers (DataLoader's pin_memory thread) pin but do not copy on a side stream.
"""
from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping

import torch

from ..errors import OptionError, UsageError
from .devices import check_device


def prefetch(loader: Iterable, device, depth: int = 2) -> "Prefetch":
    """`loader`'s batches on `device`, each copied while the steps before it run (module doc)."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise OptionError(f"prefetch(depth={depth!r}): depth is how many batches are copied ahead, a whole number "
                          "of at least 1 (2 hides one batch's copy behind the step before it).")
    if not isinstance(loader, Iterable):
        raise UsageError(f"prefetch takes what a training loop iterates over (a DataLoader, a list of batches); "
                         f"got {type(loader).__name__}, which is not iterable.")
    return Prefetch(loader, check_device(device), depth)


class Prefetch:
    """An iterable over `loader`'s batches moved to `device`, `depth` ahead. Iterating again
    iterates the loader again (a new epoch); len() is the loader's, where it has one."""

    def __init__(self, loader: Iterable, device: torch.device, depth: int):
        self.loader, self.device, self.depth = loader, device, depth

    def __iter__(self):
        return _Ahead(iter(self.loader), self.device, self.depth)

    def __len__(self) -> int:
        return len(self.loader)  # TypeError where the loader has no length, as for the loader itself


class _Ahead:
    """One pass over a loader: a queue of up to `depth` batches whose copies were started."""

    def __init__(self, batches, device: torch.device, depth: int):
        self.batches, self.device, self.depth = batches, device, depth
        self.cuda = device.type == "cuda"  # derived once: the copy's form for every batch
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.queue: collections.deque = collections.deque()
        self.done = False
        while len(self.queue) < depth and self._start_next():
            pass

    def __iter__(self):
        return self

    def __next__(self):
        if not self.queue:
            raise StopIteration
        batch, copied = self.queue.popleft()
        self._start_next()  # the next copy runs while the step reads this batch
        if copied is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(copied)
            for t in _tensors(batch):
                t.record_stream(stream)
        return batch

    def _start_next(self) -> bool:
        """The next batch's copy started and queued; False once the loader is done."""
        if self.done:
            return False
        try:
            batch = next(self.batches)
        except StopIteration:
            self.done = True
            return False
        if not self.cuda:
            self.queue.append((_moved(batch, lambda t: t.to(self.device)), None))
            return True
        with torch.cuda.stream(self.stream):
            moved = _moved(batch, self._copy)
            copied = self.stream.record_event()
        self.queue.append((moved, copied))
        return True

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)


def _moved(batch, move):
    """batch with every tensor in it replaced by move(tensor), its containers rebuilt alike."""
    if isinstance(batch, torch.Tensor):
        return move(batch)
    if isinstance(batch, Mapping):
        items = {k: _moved(v, move) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:  # a mapping that cannot be built from a dict
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_moved(v, move) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_moved(v, move) for v in batch)
    return batch


def _tensors(batch) -> list[torch.Tensor]:
    found = []
    _moved(batch, lambda t: found.append(t) or t)
    return found
