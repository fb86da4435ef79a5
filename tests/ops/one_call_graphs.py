"""One-call FX graphs over fixed placeholders, the nodes the ops tests look up and bind."""
import torch
from torch.fx import Graph

from op_cases import randn


def graph_with(op, target, args, kwargs=None):
    """A one-call graph over placeholders x, y, c (bool), i (int64), with values in meta; returns the call."""
    g, nodes = Graph(), {}
    for name, v in {"x": randn(2, 3), "y": randn(2, 3), "c": randn(2, 3) > 0, "i": torch.tensor([0, 1])}.items():
        nodes[name] = g.placeholder(name)
        nodes[name].meta["val"] = v
    sub = lambda a: nodes[a] if isinstance(a, str) and a in nodes else a
    fix = lambda a: type(a)(sub(i) for i in a) if isinstance(a, (tuple, list)) else sub(a)
    node = getattr(g, op)(target, tuple(fix(a) for a in args), {k: fix(v) for k, v in (kwargs or {}).items()})
    g.output(node)
    return node


def fn(target, *args, **kwargs):
    return graph_with("call_function", target, args, kwargs)


def method(name, *args, **kwargs):
    return graph_with("call_method", name, args, kwargs)
