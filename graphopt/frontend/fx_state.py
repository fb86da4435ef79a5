"""The fx frontend and the model's state: what forward does to buffers goes in the graph, and
tracing itself leaves the state as it found it.

symbolic_trace runs forward once with proxies. Buffers read as attributes are proxies too
(trace._Tracer), so an in-place update of one (`self.ema.mul_(0.9)`) is recorded like any op.
A buffer forward rebinds (`self.steps += 1` on a proxy is an add, then an assignment) holds a
Proxy once tracing ends: StateWatch puts the buffer back and the graph copies the new value
into it before returning, once per call, as torch.export writes mutated buffers back.

The modules' other attributes are put back as well: a forward that caches what it computes
(timm LeViT keeps its attention biases in a dict in eval mode) leaves a Proxy, or under
export a FakeTensor, in the cache otherwise, and the user's model then holds it for good
(copy.deepcopy of it fails, and a later cache hit would read it).
"""
from __future__ import annotations

import copy

import torch
import torch.fx

from ..analysis import meta
from ..analysis.trial import Snapshot
from ..errors import TraceError

WRITE_BACK = "graphopt_write_back"  # on the copy_ that writes a buffer forward rebinds: its name


class StateWatch:
    """Keeps fx tracing from touching the model's state, and puts forward's buffer writes in the graph.

    A buffer that forward rebinds (`self.steps = self.steps + 1`, or `+=`, which fx records as
    an add) holds a Proxy once tracing ends: the buffer is put back and the graph copies the
    new value into it before returning, once per call (torch.export writes mutated buffers
    back the same way). A write that still ran at trace time (a buffer reached other than as an
    attribute, a value computed outside the graph) cannot be replayed: the state is restored
    and fx refuses the model, so the export frontend captures it.
    """

    def __init__(self, model: torch.nn.Module, refuse: bool = True):
        self.refuse = refuse  # False: only restore (export records what it runs)
        self.slots = [(path, m, name, t) for path, m in model.named_modules(remove_duplicate=False)
                      for kind in ("_buffers", "_parameters") for name, t in getattr(m, kind).items()]
        self.names = {id(t): f"{path}.{name}" if path else name for path, _, name, t in self.slots}
        self.values = Snapshot([t for *_, t in self.slots if t is not None and not isinstance(t, torch.nn.Parameter)])
        self.attributes = [_Attributes(m) for m in model.modules()]

    def __enter__(self):
        return self

    def write_back(self, graph: torch.fx.Graph) -> None:
        """After tracing: restore rebound buffers, and copy the values forward gave them before the output."""
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        for path, module, name, original in self.slots:
            now = module._buffers.get(name, module._parameters.get(name))
            if now is original:
                continue
            self._restore()
            if not isinstance(now, torch.fx.Proxy):
                raise TraceError(f"forward assigns {type(now).__name__} to {path + '.' if path else ''}{name} "
                                 "outside the graph")
            target = f"{path}.{name}" if path else name
            with graph.inserting_before(output):
                write = graph.call_method("copy_", (graph.get_attr(target), now.node))
            write.meta[WRITE_BACK] = target

    def _restore(self) -> None:
        for _, module, name, original in self.slots:
            (module._parameters if name in module._parameters else module._buffers)[name] = original

    def __exit__(self, kind, error, tb):
        self._restore()
        for attributes in self.attributes:
            attributes.restore()
        written = [self.names[id(t)] for t in self.values.restore()]
        if written and error is None and self.refuse:
            raise TraceError(f"tracing wrote {', '.join(written[:3])} in place outside the graph (its forward "
                             "reaches the buffer other than as a module attribute); the state is restored")
        return False


class _Attributes:
    """A module's plain attributes (not its parameters, buffers or submodules: those are
    torch's, in the underscored dicts), and the contents of the dicts, lists and sets among them."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.values = {k: v for k, v in vars(module).items() if not k.startswith("_")}
        self.contents = {k: copy.copy(v) for k, v in self.values.items() if type(v) in (dict, list, set)}

    def restore(self) -> None:
        now = vars(self.module)
        for k in [k for k in now if not k.startswith("_") and k not in self.values]:
            del now[k]
        now.update(self.values)
        for k, saved in self.contents.items():  # refilled as they were: comparing would call tensors' ==
            value = self.values[k]
            value.clear()
            if type(value) is list:
                value.extend(saved)
            else:
                value.update(saved)


def check_write_backs(gm: torch.fx.GraphModule) -> None:
    """A write-back copies into the buffer; eager rebinds it. Same values only when the new one
    has the buffer's shape and dtype and carries no autograd history."""
    for node in gm.graph.nodes:
        if WRITE_BACK not in node.meta:
            continue
        buffer, value = (meta.tensor_info(a) for a in node.args)
        if value is None or (value.shape, value.dtype) != (buffer.shape, buffer.dtype) or value.requires_grad:
            got = "no tensor" if value is None else f"{value.short()}{' requiring grad' if value.requires_grad else ''}"
            raise Unreplayable(
                f"forward rebinds buffer {node.meta[WRITE_BACK]} ({buffer.short()}) to {got}; a graph replays a "
                "buffer update by copying into the buffer (torch.export too), which keeps its shape and dtype and "
                "drops autograd history: give the new value the buffer's shape and dtype, detached")


class Unreplayable(TraceError):
    """The model does something no frontend replays as eager does: no other frontend is tried."""
