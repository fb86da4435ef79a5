"""Rewrite fusion candidates joined by reshapes to compute in one shape, so one group can take
them all (view_frames.py finds the regions and their shape F).

For each region, in graph order: a value from outside that a member reads enters reshaped into
its form in F (a 0-dim tensor stays as it is: it promotes as a scalar does); a member computes
on values in F; a reshape inside goes, its readers read its input's value; a value a node
outside reads leaves reshaped back to its own shape. Eager computes the same elements either
way: every reshape involved keeps the elements' order, and the broadcasts read the same
elements. The reshapes are written at the example's sizes, so the pass that calls this marks
the graph specialized to them.
"""
from __future__ import annotations

import torch.fx

from ... import ops
from ...analysis.effects import CALLS
from ...analysis.meta import TensorInfo, tensor_info
from .row_members import NORMALIZING, REDUCING
from .view_frames import ELEMENTWISE, FIXED, ROWS, Region, find_regions, reorder_free_view

_LAST = (-1, (-1,), [-1])


def _kind(node: torch.fx.Node, member, gm: torch.fx.GraphModule) -> str | None:
    """A candidate's kind in a region (view_frames.py), or None for one that stays out of them:
    one whose layout or operands a region would change (eager lays it out strided, a bias its
    matmul adds, a rotation's shifted reads)."""
    if member.strided or member.epilogue or member.absorbed:
        return None
    if member.row is None:
        return ELEMENTWISE
    if member.row.col_dims != (len(member.row.shape) - 1,):
        return FIXED
    # row_members checked the op reduces or normalizes the last dim (and keeps it); a dim given
    # by number is the last dim only at this rank, and a rewritten member's rank changes
    bound = ops.bind(node, gm)
    params = bound.params if bound is not None else {}
    by_shape = "normalized_shape" in params  # a norm names the dims it normalizes by their sizes
    if member.op in REDUCING + NORMALIZING and member.op != "cross_entropy" and (by_shape or params.get("dim") in _LAST):
        return ROWS
    return FIXED


def lift_views(gm: torch.fx.GraphModule, members: dict, written: dict) -> list[Region]:
    """Rewrite each region of these candidates (node -> fusion Member) in its shape; the regions."""
    eligible = {}
    for node, member in members.items():
        kind = _kind(node, member, gm)
        if kind is not None:
            eligible[node] = kind
    views = {n for n in gm.graph.nodes if n.op in CALLS and reorder_free_view(n, ops.lookup(n, gm), written)}
    regions = find_regions(gm, eligible, views)
    for region in regions:
        _rewrite(gm, region, eligible)
    if regions:
        gm.graph.lint()
        gm.recompile()
    return regions


def _rewrite(gm: torch.fx.GraphModule, region: Region, eligible: dict) -> None:
    graph = gm.graph
    inside, views = set(region.nodes), set(region.views)
    value: dict = {}  # a region node -> the node giving its value in F
    entered: dict = {}  # (outside node, shape) -> its reshape

    def enter(v: torch.fx.Node, frame, before: torch.fx.Node) -> torch.fx.Node:
        info = tensor_info(v)
        if not isinstance(info, TensorInfo) or not info.shape:
            return v
        shape = region.form(info.shape, frame)
        if shape is None:  # find_regions keeps only members whose operands have a form in F
            raise ValueError(f"{v.name} {list(info.shape)} has no form in {list(region.shape)}")
        if shape == tuple(info.shape):
            return v
        if (v, shape) not in entered:
            with graph.inserting_before(before):
                entered[(v, shape)] = graph.call_method("reshape", (v, *shape))
        return entered[(v, shape)]

    for node in region.nodes:
        if node in views:
            value[node] = value[node.all_input_nodes[0]]
            continue
        # a norm's weights stay; a member computed in its own shape reads values already in it
        operands = node.all_input_nodes if eligible[node] == ELEMENTWISE else node.all_input_nodes[:1]
        for v in dict.fromkeys(operands):
            node.replace_input_with(v, value[v] if v in inside else enter(v, region.frames[node], node))
        for v in dict.fromkeys(node.all_input_nodes):  # a reshape that goes, read as a norm's weight
            if v in views:
                with graph.inserting_before(node):
                    node.replace_input_with(v, graph.call_method("reshape", (value[v], *tensor_info(v).shape)))
        value[node] = node
    for node in region.nodes:
        outside = [u for u in node.users if u not in inside]
        if not outside:
            continue
        with graph.inserting_after(value[node]):
            back = graph.call_method("reshape", (value[node], *tensor_info(node).shape))
        for user in outside:
            user.replace_input_with(node, back)
    for view in reversed(region.views):
        graph.erase_node(view)
