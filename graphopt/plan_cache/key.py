"""What a plan reads, as one JSON-able value: its cache key.

The graph as traced is part of the key, node by node (op, name, target, arguments, and the
dtype, shape, strides and device each node makes), so the model's code, its config and the
inputs' sizes are in it through what they traced to; so are the parameters' and buffers'
names, dtypes, shapes, devices and requires_grad, the tensor attributes the graph reads, the
pass's options and the pipeline's settings, the device planned for and the GPU's model, and the
versions of torch, CUDA and Triton and a digest of graphopt's own source (a plan made by other code is not this code's
plan). A call or module target that is a Python function is keyed by its bytecode and
constants too, a higher-order op by its name, any other object by its type and repr
(graphopt's runtime callables describe what they compute there; an address in a repr makes
the key new each process: a miss, never a wrong hit).
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys

import torch
import torch.fx

from ..analysis.meta import tensor_info
from ..analysis.planning_device import planning_device


def graph_key(gm: torch.fx.GraphModule) -> list:
    """gm node by node (op, name, target, arguments, the tensor each makes) and its state."""
    nodes = [[n.op, n.name, _target(gm, n), _value(n.args), _value(n.kwargs), repr(tensor_info(n))]
             for n in gm.graph.nodes]
    state = [[name, str(t.dtype), list(t.shape), str(t.device), bool(t.requires_grad)]
             for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]]
    return [nodes, state]


def environment_key() -> dict:
    """The versions and the device that decide a plan besides the graph."""
    triton = sys.modules.get("triton")
    # a GPU's model sets its cuBLAS workspaces and the cost model's rates
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu,
            "triton": getattr(triton, "__version__", None), "graphopt": source_digest(),
            "planning_device": planning_device()}


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 over graphopt's own .py files, by path: any change to the code that plans."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def _target(gm: torch.fx.GraphModule, n: torch.fx.Node) -> str | list:
    if n.op == "call_module":
        module = gm.get_submodule(n.target)
        if isinstance(module, torch.fx.GraphModule):  # a subgraph: by its own nodes
            return [n.target, graph_key(module)]
        return f"{n.target}:{type(module).__module__}.{type(module).__qualname__}({module.extra_repr()})" \
               f"{_code(type(module).forward)}"
    if n.op == "get_attr":
        value = _attribute(gm, n.target)
        if isinstance(value, torch.Tensor):
            return f"{n.target}:{value.dtype}{list(value.shape)}:{_tensor_digest(value)}"
        if isinstance(value, torch.fx.GraphModule):  # a higher-order op's subgraph
            return [n.target, graph_key(value)]
        return f"{n.target}:{type(value).__qualname__}"
    if isinstance(n.target, str):
        return n.target
    if isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(n.target)
    if isinstance(n.target, torch._ops.HigherOrderOperator):  # its subgraph is a get_attr node of its own
        return f"higher_order.{n.target.name()}"
    name = f"{getattr(n.target, '__module__', '')}.{getattr(n.target, '__qualname__', type(n.target).__qualname__)}"
    return name + _code(n.target) if callable(n.target) and hasattr(n.target, "__code__") else f"{name}:{n.target!r}"


def _code(fn) -> str:
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    return ":" + hashlib.sha256(code.co_code + repr(code.co_consts).encode() + repr(code.co_names).encode()).hexdigest()[:16]


def _attribute(gm: torch.fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _tensor_digest(t: torch.Tensor) -> str:
    """A small constant's values (a table folded at trace time); a large one's by its size only,
    where its values cannot change what a memory plan decides."""
    if t.device.type == "meta" or t.numel() > 4096:
        return "size"
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _value(v) -> object:
    if isinstance(v, torch.fx.Node):
        return f"%{v.name}"
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, *[_value(x) for x in v]]
    if isinstance(v, dict):
        return {str(k): _value(x) for k, x in v.items()}
    if isinstance(v, torch.Tensor):
        return f"tensor:{v.dtype}{list(v.shape)}:{_tensor_digest(v)}"
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return f"{type(v).__qualname__}:{v!r}"
