"""cse: merge nodes that compute the same pure op on the same arguments.

Algorithm:
  1. Find the values that something mutates or hands to an opaque call, and every value
     sharing their storage (effects.written_values): they hold different data at different
     points, so neither they nor anything reading them merges.
  2. Walk the graph in order, keying each pure node (analysis/effects.py) by its target and
     its arguments (nodes by identity, containers and slices made hashable). In training,
     a value autograd differentiates stays unmerged: one node's backward fed the sum of two
     gradients rounds differently from two backwards summed (T5's position bias), and
     cleanups keep eager's numbers bitwise. Index arithmetic, masks and positions merge.
  3. A node whose key was seen before is replaced by the earlier node.
  4. Report merged nodes by op.
"""
from __future__ import annotations

import torch.fx

from ..analysis.effects import pure_op, written_values
from ..analysis.meta import leaves, tensor_info
from .base import Pass, PassContext, PassResult
from .registry import register


def _key(value):
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return ("dict",) + tuple(sorted((k, _key(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _key(value.start), _key(value.stop), _key(value.step))
    if isinstance(value, torch.fx.Node):
        return ("node", id(value))
    hash(value)  # unhashable constants raise TypeError: that node is not merged
    return (type(value).__name__, value)


def _differentiated(node: torch.fx.Node) -> bool:
    return any(i.requires_grad for i in leaves(tensor_info(node)))


@register
class CommonSubexpressionElimination(Pass):
    """Compute each pure expression once."""

    name = "cse"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        # Step 1
        unsafe = written_values(gm)
        seen: dict[tuple, torch.fx.Node] = {}
        merged: dict[str, int] = {}
        # Step 2
        for node in list(gm.graph.nodes):
            op = pure_op(node, gm)
            if (op is None or node in unsafe or any(n in unsafe for n in node.all_input_nodes)
                    or (ctx.train and _differentiated(node))):
                continue
            try:
                key = (node.op, node.target if isinstance(node.target, str) else id(node.target),
                       _key(node.args), _key(node.kwargs))
            except TypeError:
                continue
            # Step 3
            earlier = seen.get(key)
            if earlier is None:
                seen[key] = node
                continue
            node.replace_all_uses_with(earlier)
            gm.graph.erase_node(node)
            merged[op.name] = merged.get(op.name, 0) + 1
        # Step 4
        return PassResult(gm, bool(merged), {"merged": sum(merged.values()), "by_op": merged})
