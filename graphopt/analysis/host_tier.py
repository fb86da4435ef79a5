"""The host as a tier below the device memory a budget covers: what a plan keeps there (the
optimizer's state and its step, analysis/host_step.py) is not device memory.

Host work runs inside `on_host()`, and the instrument that counts a step's storages
(live_storage.py) counts nothing made there. On CUDA the host's tensors are on the CPU, where
the allocator's statistics never see them; on CPU, where host and device are one memory, the
host's copies are still storages of their own, kept out of the device's count by this mark,
so that a CPU step measures what the same step on CUDA holds on the device.
"""
from __future__ import annotations

import contextlib
import threading

_depth = threading.local()


def host_work() -> bool:
    """Whether the calling thread is doing host work now (inside on_host())."""
    return getattr(_depth, "n", 0) > 0


@contextlib.contextmanager
def on_host():
    """While open, what this thread makes is the host's, not the device's."""
    _depth.n = getattr(_depth, "n", 0) + 1
    try:
        yield
    finally:
        _depth.n -= 1
