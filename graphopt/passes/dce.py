"""dce: remove nodes whose results nothing uses.

Algorithm:
  1. Walk the graph backwards (torch.fx's eliminate_dead_code does this).
  2. Remove a node when it has no users and the registry calls it pure (analysis/effects.py):
     opaque, random, mutating and asserting ops stay even when unused, but for an export
     graph's metadata assertions that its input guards already settle (effects.settled_check).
  3. Report the removed nodes by op.
"""
from __future__ import annotations

import torch.fx

from .. import ops
from ..analysis.effects import is_impure
from .base import Pass, PassContext, PassResult
from .registry import register


@register
class DeadCodeElimination(Pass):
    """Remove unused pure nodes."""

    name = "dce"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        before = {n.name: n for n in gm.graph.nodes}
        # Step 1, 2
        gm.graph.eliminate_dead_code(is_impure_node=lambda n: is_impure(n, gm))
        after = {n.name for n in gm.graph.nodes}
        # Step 3
        removed: dict[str, int] = {}
        for name, node in before.items():
            if name not in after:
                op = ops.lookup(node, gm) if node.op != "get_attr" else None
                key = op.name if op else node.op
                removed[key] = removed.get(key, 0) + 1
        return PassResult(gm, bool(removed), {"removed": sum(removed.values()), "by_op": removed})
