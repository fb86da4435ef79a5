"""A model's own torch.autograd.Functions, kept whole in the graph with their own backward.

Both frontends trace through `Function.apply` into the ops of its forward, and autograd then
differentiates those ops: the Function's backward is lost. Where the backward is the derivative
of the forward written to save less (BLOOM's GeLUFunction saves its input only; its forward's
ops save five tensors) the step silently keeps more memory; where it is not (a straight-through
estimator: `round` forward, identity backward) the gradients are silently wrong (zero).

While a frontend traces (`keeping()`), `apply` of a Function defined outside torch and graphopt
records one call instead: fx gets a call_function node whose target is a FunctionCall; export,
which can only keep operators, gets the operator graphopt::autograd_function, replaced by the
same FunctionCall once exported (`restore`). A FunctionCall runs `apply` itself: forward, its
saved tensors and backward are the Function's, as in eager.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import TraceError

_FUNCTION = torch.autograd.Function
_APPLY = _FUNCTION.__dict__["apply"]  # the classmethod itself: restored on exit
_state = threading.local()
_calls: dict[int, "_ExportCall"] = {}  # live only between a call's trace and restore()
_keys = itertools.count()


class FunctionCall:
    """A call_function target: `Function.apply(*args, **kwargs)`, its arguments as structured at
    trace time (export: the tensors flat, the rest constants, and the result returned flat)."""

    def __init__(self, function: type, structure=None):
        self.function, self.structure = function, structure
        self.__name__ = self.__qualname__ = f"{function.__name__}_apply"

    def __call__(self, *args, **kwargs):
        if self.structure is None:
            return _APPLY.__func__(self.function, *args, **kwargs)
        spec, constants = self.structure
        call_args, call_kwargs = pytree.tree_unflatten(_filled(constants, args), spec)
        result = _APPLY.__func__(self.function, *call_args, **call_kwargs)
        return tuple(t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor))

    def __repr__(self) -> str:
        return f"FunctionCall({self.function.__module__}.{self.function.__qualname__})"


_TENSOR = object()  # marks where a flat tensor goes among a call's constants


def _filled(leaves: list, tensors) -> list:
    """The leaves with each _TENSOR mark replaced by the next of `tensors`, in order."""
    tensors = iter(tensors)
    return [next(tensors) if c is _TENSOR else c for c in leaves]


@dataclass
class _ExportCall:
    function: type
    spec: object
    constants: list
    result_spec: object = None
    result_leaves: list = field(default_factory=list)


@torch.library.custom_op("graphopt::autograd_function", mutates_args=())
def _autograd_function(tensors: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    raise RuntimeError("graphopt::autograd_function stands for a call only while graphopt traces a model")


@_autograd_function.register_fake
def _(tensors, key):
    call = _calls[key]
    args, kwargs = pytree.tree_unflatten(_filled(call.constants, tensors), call.spec)
    with torch.no_grad():
        result = _APPLY.__func__(call.function, *args, **kwargs)
    leaves, call.result_spec = pytree.tree_flatten(result)
    call.result_leaves = [_TENSOR if isinstance(t, torch.Tensor) else t for t in leaves]
    # fresh tensors: an operator's results may not alias its inputs (a Function may return one)
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            for t in leaves if isinstance(t, torch.Tensor)]


def _kept(function: type) -> bool:
    """Whether apply of this Function is kept whole: the model's own, not torch's or graphopt's
    (their Functions are internals a graph may run through, such as reentrant checkpointing)."""
    module = getattr(function, "__module__", "") or ""
    return not module.startswith(("torch.", "graphopt."))


def _apply(cls, *args, **kwargs):
    frontend = getattr(_state, "frontend", None)
    if frontend is None or not _kept(cls):
        return _APPLY.__func__(cls, *args, **kwargs)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if frontend == "fx":
        proxy = next((v for v in leaves if isinstance(v, torch.fx.Proxy)), None)
        if proxy is None:
            return _APPLY.__func__(cls, *args, **kwargs)
        return proxy.tracer.create_proxy("call_function", FunctionCall(cls), args, kwargs)
    if any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) for v in leaves):
        raise TraceError(f"{cls.__qualname__}.apply is given a size computed from the batch, which graphopt "
                         f"cannot keep with the Function's own backward")
    key = next(_keys)
    _calls[key] = call = _ExportCall(cls, spec, [_TENSOR if isinstance(v, torch.Tensor) else v for v in leaves])
    flat = torch.ops.graphopt.autograd_function(
        [v for v in leaves if isinstance(v, torch.Tensor)], key)
    return pytree.tree_unflatten(_filled(call.result_leaves, flat), call.result_spec)


_lock = threading.Lock()
_open = 0  # keeping() contexts open, in every thread: the last one out puts torch's apply back


@contextlib.contextmanager
def keeping(frontend: str):
    """While open, apply of a model's Function is recorded as one call by `frontend` ("fx" or
    "export") in this thread; torch's own apply runs everywhere else, and again on exit."""
    global _open
    previous = getattr(_state, "frontend", None)
    with _lock:
        _open += 1
        _FUNCTION.apply = classmethod(_apply)
    _state.frontend = frontend
    try:
        yield
    finally:
        _state.frontend = previous
        with _lock:
            _open -= 1
            if not _open:
                _FUNCTION.apply = _APPLY


def restore(gm: torch.fx.GraphModule) -> None:
    """Replace each graphopt::autograd_function of an exported graph by the FunctionCall it
    stands for, taking the same tensors and returning the same flat tuple."""
    op = torch.ops.graphopt.autograd_function.default
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not op:
            continue
        key = node.args[1]
        call = _calls.pop(key)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(FunctionCall(call.function, (call.spec, call.constants)), tuple(node.args[0]))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
