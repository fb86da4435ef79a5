"""Node order the recompute pass plans on: a segment is a contiguous run of nodes, so what would
cut runs apart moves out of the way first (before the step's estimate, which then serves the
search too).

  - attribute reads move to just after the placeholders (attributes_first);
  - a state write that reads no computed value (BatchNorm's num_batches_tracked.add_(1)) moves
    up to the last placeholder it reads (hoist_state_writes).

Both keep the graph's results: they move nodes past others that do not read what they make.
"""
from __future__ import annotations

import torch.fx

from .rewrite import recomputable


def hoist_state_writes(gm: torch.fx.GraphModule) -> int:
    """Move each node that cannot be recomputed but reads only placeholders and attributes
    (num_batches_tracked.add_(1) beside each batch norm, from export or a BatchNorm written in
    Python) up to the last placeholder it reads, with the attribute reads it needs, when no
    node in between reads them: segments are then not cut around it."""
    moved = 0
    nodes = list(gm.graph.nodes)
    start = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=-1)
    for n in list(nodes):
        if n.op not in ("call_function", "call_method") or n.users or recomputable(n, gm) is None:
            continue
        inputs = n.all_input_nodes
        if not inputs or any(i.op not in ("placeholder", "get_attr") for i in inputs):
            continue
        k = nodes.index(n)
        place = max([start] + [nodes.index(i) for i in inputs if i.op == "placeholder"])
        state = {i.target for i in inputs if i.op == "get_attr"}
        movers = [i for i in inputs if i.op == "get_attr" and nodes.index(i) > place] + [n]
        if place >= k or nodes[place + 1:place + 1 + len(movers)] == movers:
            continue  # among the placeholders (fx's asserts on concrete arguments), or already there
        if any(i in inputs or (i.op == "get_attr" and i.target in state)
               for m in nodes[place + 1:k] for i in m.all_input_nodes):
            continue
        anchor = nodes[place] if place >= 0 else None
        for m in movers:
            nodes.remove(m)
            if anchor is None:
                next(iter(gm.graph.nodes)).prepend(m)
            else:
                anchor.append(m)
            nodes.insert(nodes.index(anchor) + 1 if anchor is not None else 0, m)
            anchor = m
        moved += 1
    return moved


def attributes_first(gm: torch.fx.GraphModule) -> int:
    """Move every attribute read to just after the placeholders. A segment reads the attributes
    it needs itself, so one left inside its node range would stay behind in the main graph and
    undoing the segment would put the nodes back in another order than the plan's."""
    nodes = list(gm.graph.nodes)
    anchor = next((n for n in reversed(nodes) if n.op == "placeholder"), None)
    moved = 0
    for n in nodes:
        if n.op != "get_attr":
            continue
        if anchor is None:
            first = next(iter(gm.graph.nodes))
            if first is not n:
                first.prepend(n)
                moved += 1
        elif anchor.next is not n:
            anchor.append(n)
            moved += 1
        anchor = n
    return moved
