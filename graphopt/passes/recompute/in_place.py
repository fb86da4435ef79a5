"""Elementwise ops written in place within a recompute plan (the recompute pass's step 6).

The inplace pass's rules (passes/inplace.py) decide, on the graph before its segments are cut,
with one more: a value that a segment reads from outside it is read again by the segment's rerun
in backward, and torch.utils.checkpoint does not check its version, so a write into it after
the segment ran would make the rerun, and the gradients, silently wrong. Nor may a write touch
what a selective segment keeps for its rerun. Run before the plan, the inplace pass would take
values the plan recomputes from, and its least budget would rise; run within
it, a write only replaces an allocation with one the step already has.
"""
from __future__ import annotations

import torch.fx

from ..inplace import plan_writes, write_in_place
from .solver import RecomputePlan

REREAD = "is a recompute segment's input, which its rerun reads again in backward"
KEPT = "is kept by a selective recompute segment for its rerun"


def rereads(nodes: list[torch.fx.Node], plan: RecomputePlan | None, facts, sel: list[int]) -> dict:
    """Storage key -> why no write may touch it: the segments' inputs, and what selective
    segments keep (sel[i]: bytes a selective segment keeps of node i)."""
    position = {n: i for i, n in enumerate(nodes)}
    found = {}
    for s in plan.segments if plan is not None else ():
        for i in range(s.start, s.stop):
            outside = [x for x in nodes[i].all_input_nodes if not s.start <= position[x] < s.stop]
            for x in outside:
                for key, _ in facts.storages.get(x.name, []):
                    found.setdefault(key, REREAD)
            if s.selective and sel[i]:
                for key, _ in facts.storages.get(nodes[i].name, []):
                    found.setdefault(key, KEPT)
    return found


def write_within(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], plan: RecomputePlan | None, facts,
                 sel: list[int]) -> tuple[dict, dict]:
    """Write in place where the rules and the plan allow, on gm before its segments are cut
    (nodes: its nodes in order, replaced where they stand); (written, left alone with why)."""
    rewrites, skipped = plan_writes(gm, facts, train=True, reread=rereads(nodes, plan, facts, sel))
    return (write_in_place(gm, rewrites) if rewrites else {}), skipped
