"""Which nodes a cleanup may remove or merge, from the registry alone.

Only ops the registry knows to be pure qualify: opaque calls may have side effects, random
ops must keep drawing from the RNG as eager does (or dropout masks change), and mutating
or asserting ops change state.
"""
from __future__ import annotations

import torch.fx

from .. import ops


def pure_op(node: torch.fx.Node, gm: torch.fx.GraphModule):
    """The node's OpInfo when it is a pure, deterministic op; None otherwise."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return None
    op = ops.lookup(node, gm)
    if op is None or op.random or op.mutates or getattr(op, "side_effect", False):
        return None
    if node.op == "call_module" and any(True for _ in gm.get_submodule(node.target).buffers()):
        return None  # BatchNorm and friends update their buffers on every call
    return op


def is_impure(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "get_attr":
        return False
    return pure_op(node, gm) is None or node.is_impure()
