"""How analyses see a recompute segment; runtime/checkpoint.py implements it.

A rewritten graph calls a SegmentCall for each segment: its GraphModule (`module`) runs in the
forward and again during backward; a selective one keeps the outputs of the ops keeps_output
names. recomputing() is True while a segment runs again, so a measurement can tell the rerun
from the first run.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch.fx

from .. import ops

_state = threading.local()


@contextlib.contextmanager
def rerun():
    """Open while a segment runs again during backward."""
    previous, _state.recomputing = getattr(_state, "recomputing", False), True
    try:
        yield
    finally:
        _state.recomputing = previous


def recomputing() -> bool:
    """True while a segment runs again during backward."""
    return getattr(_state, "recomputing", False)


@functools.lru_cache(maxsize=None)
def keeps_output(target) -> bool:
    """Whether a selective segment keeps the op's output: matmuls, convolutions and attention,
    whose rerun costs FLOPs; every other op is rerun."""
    op = ops.lookup_target(target)
    return op is not None and op.kind == "matmul"


class SegmentCall:
    """The callable a rewritten graph calls for segment `index`; offloaded: its inputs wait on the
    host until its backward (runtime/offload.py)."""

    offloaded = False

    def __init__(self, index: int, module: torch.fx.GraphModule, selective: bool = False):
        self.index, self.module, self.selective = index, module, selective
        self.__name__ = self.__qualname__ = f"recompute_segment_{index}"


def segment_modules(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """The GraphModule of every segment gm calls."""
    return [n.target.module for n in gm.graph.nodes if isinstance(n.target, SegmentCall)]


def segment_parameters(segment: SegmentCall) -> list[torch.nn.Parameter]:
    """The parameters a segment's run reads: its module's, and those of a module a call in it holds
    (a batch norm run once, runtime/checkpoint.BatchNormOnce, which keeps its module outside the graph's)."""
    params = list(segment.module.parameters())
    for n in segment.module.graph.nodes:
        held = getattr(n.target, "module", None) if n.op == "call_function" else None
        if isinstance(held, torch.nn.Module):
            params += held.parameters()
    return params
