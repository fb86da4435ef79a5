"""Per node, what the recompute pass plans with: the step's record (analysis/saved.py) read in
graph order, once per plan search.

A node that cannot run twice keeps its reason (rewrite.recomputable), which the dumps show on it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from ...analysis.saved import StepFacts, params_read
from .rewrite import recomputable


@dataclass
class NodeFacts:
    """Lists in graph order, one entry per node."""

    nodes: list[torch.fx.Node]
    why_not: list[str | None]  # why it may not run twice (None: it may)
    kept: list[int]            # bytes it keeps for backward
    live_after: list[int]      # bytes live across the gap after it
    grads: list[int]           # parameter gradients its backward makes first
    saves: list[int]           # when it hands autograd what its backward needs (StepFacts.save_points)
    sel: list[int]             # bytes a selective segment keeps of it
    ops: list[int]             # aten calls a selective segment's policy sees in it

    @property
    def ok(self) -> list[bool]:
        return [why is None for why in self.why_not]


def node_facts(gm: torch.fx.GraphModule, step: StepFacts) -> NodeFacts:
    """The facts of gm's nodes from its step's record. A node's parameter gradients are those of
    the trainable parameters it is the last to read (backward runs in reverse)."""
    nodes = list(gm.graph.nodes)
    kept, live_after = step.kept_and_live(nodes)
    last_reader = {}
    for i, n in enumerate(nodes):
        for key, p in params_read(gm, n).items():
            if p.requires_grad:
                last_reader[key] = (i, p.untyped_storage().nbytes())
    grads = [0] * len(nodes)
    for i, nbytes in last_reader.values():
        grads[i] += nbytes
    return NodeFacts(nodes, [recomputable(n, gm) for n in nodes], kept, live_after, grads, step.save_points(nodes),
                     [step.policy_bytes.get(n.name, 0) for n in nodes], [step.policy_calls.get(n.name, 0) for n in nodes])
