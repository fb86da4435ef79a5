"""What a call the registry does not list does, read from the ATen operators it dispatches (an
analysis).

Annotation (trace.annotate) runs each such call (a torch function, a Tensor method, a leaf
module's forward, an ATen operator without an entry) on FakeTensors inside `recording()`, a
dispatch mode that notes every operator the call reaches, and keeps their summary on the node
(`Dispatched`). From the operators' schemas: whether the call writes memory (an argument its
schema marks written, or a tensor's metadata changed in place), whether it draws random numbers
(tagged nondeterministic_seeded), and whether it reaches something no schema describes (a
higher-order operator). effects.py answers from it what cse, dce, recompute and inplace ask of
such a node, under either frontend; a call that dispatches nothing (x.shape) writes nothing.
What Python does besides (a counter kept on a module) no dispatch shows: the schemas are the
contract torch.export's graphs, and torch.fx's own dead-code elimination, trust too.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

DISPATCHED = "graphopt_dispatched"


@dataclass(frozen=True)
class Dispatched:
    ops: tuple[str, ...]  # the operators reached, each once, in order of first dispatch
    writes: str | None = None  # the first that writes memory, as "aten.copy_.default writes self"
    draws: str | None = None  # the first that draws random numbers
    unread: str | None = None  # the first whose effects no schema describes


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.setdefault(func, None)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def recording():
    """Inside, every operator dispatched is noted; yields the recorder, read by `summary` after."""
    recorder = _Recorder()
    with recorder:
        yield recorder


def summary(recorder: _Recorder) -> Dispatched:
    writes = draws = unread = None
    for func in recorder.seen:
        if not isinstance(func, torch._ops.OpOverload):
            unread = unread or str(func)
            continue
        if writes is None:
            written = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            if written or torch.Tag.inplace_view in func.tags:
                writes = f"{func} writes {', '.join(written) or 'a view in place'}"
        if draws is None and torch.Tag.nondeterministic_seeded in func.tags:
            draws = str(func)
    return Dispatched(tuple(str(f) for f in recorder.seen), writes, draws, unread)


def dispatched(node: torch.fx.Node) -> Dispatched | None:
    """What the call node dispatched when annotation ran it; None where it was not recorded."""
    return node.meta.get(DISPATCHED)
