"""Fusion candidates joined by reshapes, and one shape to compute them all in (an analysis: it
reads the graph, never mutates).

A reshape keeps the elements' order, so elementwise work on either side of it is elementwise
work over one index space; only the shapes differ, and with them what a broadcast operand
means (Swin's attention mask of [1, nW, 1, N, N] is read against scores of [B, nW, H, N, N],
which were [B*nW, H, N, N] one view before). A *region* is a set of candidates (elementwise
ops, a stochastic depth's noise, norms and softmaxes over the last dim) connected through
reshapes between them. Its *frame* F is a shape that every value in it can be written in:

  1. Each value has a frame shape: its own when it has the region's element count, else that
     of a neighbour in the region it broadcasts against (a per-row mean, a per-sample noise).
  2. F is the coarsest common refinement of the frame shapes (every frame dim is a run of
     consecutive F dims), when one exists: the sizes' suffix products must divide each other.
  3. A value of shape s broadcast in its frame S is written in F through their common
     refinement: each of F's dims gets its size where s has all the finer dims it spans, 1
     where s broadcasts along all of them. When F refines S, every value has such a form.
  4. A member over rows (a norm, a softmax, a reduction over the last dim with keepdim) stays
     one only when F keeps its last dim whole: F[-1] is its frame's. A member whose op reads
     dims by number (a batch norm's channels are dim 1) is not rewritten: it stays only when F
     is its frame, and then F is its frame (LeViT's BatchNorm1d of x.flatten(0, 1), whose
     result is reshaped back and activated).
A value outside the region that a member reads enters reshaped into its form in F, and a
member's value used outside leaves reshaped back to its own shape (views.py rewrites the
graph so); inside, the reshapes are gone and fusion sees one shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch.fx

from ...analysis.meta import TensorInfo, tensor_info

# a candidate's kind in a region: computed element by element, over rows of its last dim (kept
# whole by F), or in its own shape only (a batch norm's channels are its dim 1)
ELEMENTWISE, ROWS, FIXED = "elementwise", "rows", "fixed"


@dataclass
class Region:
    nodes: list[torch.fx.Node]  # graph order: members and the reshapes between them
    views: list[torch.fx.Node]  # the reshapes, which go
    frames: dict  # member -> the shape it is computed in before the rewrite (its frame)
    shape: tuple  # F

    def form(self, shape, frame) -> tuple | None:
        """A value of `shape` read against `frame`, written in F (step 3)."""
        return written_in(shape, frame, self.shape)


def refinement(shapes) -> tuple | None:
    """The coarsest shape that splits each of these shapes' dims (all of one element count) into
    runs of its dims; None when there is none. Dims of size 1 count for nothing."""
    bounds = {1}
    for shape in shapes:
        bounds.update(math.prod(shape[d:]) for d in range(len(shape)))
    chain = sorted(bounds)
    sizes = []
    for inner, outer in zip(chain, chain[1:]):
        if outer % inner:
            return None
        sizes.append(outer // inner)
    return tuple(reversed(sizes))


def runs(shape, fine) -> list[range] | None:
    """Per dim of shape, the run of dims of `fine` it splits into (empty for a dim of 1); None
    when fine does not refine shape."""
    out, d = [], len(fine)
    for size in reversed(shape):
        end, product = d, 1
        while product < size and d > 0:
            d -= 1
            product *= fine[d]
        if product != size:
            return None
        out.append(range(d, end))
    return list(reversed(out)) if d == 0 or math.prod(fine[:d]) == 1 else None


def broadcasts(shape, frame) -> bool:
    """Whether a value of `shape` broadcasts against `frame` without changing it."""
    shape, frame = tuple(shape), tuple(frame)
    return len(shape) <= len(frame) and all(s in (1, f) for s, f in zip(reversed(shape), reversed(frame)))


def written_in(shape, frame, target) -> tuple | None:
    """A value of `shape`, broadcast as eager broadcasts it against `frame`, in the dims of
    `target` (of the frame's element count): target's size on a dim where the value has all it
    spans, 1 where it broadcasts along all of it; None where neither holds, or the two shapes
    have no common refinement."""
    shape, frame = tuple(shape), tuple(frame)
    fine = refinement([frame, tuple(target)]) if broadcasts(shape, frame) else None
    spans = runs(frame, fine) if fine is not None else None
    if spans is None:
        return None
    full = [False] * len(fine)  # per fine dim: whether the value has it
    for size, span in zip((1,) * (len(frame) - len(shape)) + shape, spans):
        for d in span:
            full[d] = size != 1
    out = []
    for size, span in zip(target, runs(target, fine)):
        had = {full[d] for d in span}
        if len(had) > 1:
            return None
        out.append(size if had == {True} else 1)
    return tuple(out)


def reorder_free_view(node: torch.fx.Node, op, written: dict) -> bool:
    """Whether the node is a reshape of a contiguous tensor into a contiguous one that nothing
    writes through: a no-op on the elements' order."""
    if op is None or not op.keeps_order or node in written:
        return False
    source = node.all_input_nodes[0] if node.all_input_nodes else None
    infos = [tensor_info(node), tensor_info(source) if source is not None else None]
    return source not in written and all(isinstance(i, TensorInfo) and i.contiguous for i in infos) \
        and infos[0].nbytes == infos[1].nbytes


def find_regions(gm: torch.fx.GraphModule, eligible: dict, views: set) -> list[Region]:
    """Regions (see the module docstring) of these candidates, eligible: member -> its kind
    (ELEMENTWISE, ROWS or FIXED), and these reshapes; only those with a reshape between two
    members."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    joining = {v for v in views if v.all_input_nodes[0] in eligible and any(u in eligible or u in views for u in v.users)}
    parent: dict = {}

    def root(n):
        while parent.setdefault(n, n) is not n:
            n = parent[n]
        return n

    inside = set(eligible) | joining
    for node in inside:
        for user in node.users:
            if user in inside:
                parent[root(user)] = root(node)
    components: dict = {}
    for node in sorted(inside, key=order.__getitem__):
        components.setdefault(root(node), []).append(node)
    regions = []
    for nodes in components.values():
        region = _region(nodes, eligible, joining)
        if region is not None:
            regions.append(region)
    return regions


def _joins(views: list, members, joining: set) -> bool:
    """Whether a reshape (or a chain of them) lies between two of these members."""
    return any(v.all_input_nodes[0] in members and any(u in members for u in _through(v, joining)) for v in views)


def _region(nodes: list, eligible: dict, joining: set) -> Region | None:
    views = [n for n in nodes if n in joining]
    members = [n for n in nodes if n not in joining]
    if not _joins(views, eligible, joining):
        return None
    counts = {math.prod(tensor_info(v).shape) for v in views}
    if len(counts) != 1:  # reshapes of values of several sizes: no one index space
        return None
    count = counts.pop()
    frames = {n: tuple(tensor_info(n).shape) for n in members if math.prod(tensor_info(n).shape) == count}
    # step 1 for values smaller than the region: a neighbour's frame they broadcast against
    changed = True
    while changed:
        changed = False
        for n in members:
            if n in frames:
                continue
            near = [v for v in [*n.all_input_nodes, *n.users] if v in frames]
            frame = next((frames[v] for v in near if broadcasts(tensor_info(n).shape, frames[v])), None)
            if frame is not None:
                frames[n] = frame
                changed = True
    shape = _shape(frames, eligible, views)
    if shape is None:
        return None
    kept = [n for n in members if n in frames and _fits(n, frames[n], eligible[n], shape)]
    given = set(kept)
    for v in views:  # graph order: a reshape of a reshape kept before it stays
        if v.all_input_nodes[0] in given:
            given.add(v)
    views = [v for v in views if v in given]
    if not _joins(views, set(kept), joining):  # what is left joins nothing: no rewrite, no specialization
        return None
    order = {n: i for i, n in enumerate(nodes)}
    return Region(sorted(kept + views, key=order.__getitem__), views, {n: frames[n] for n in kept}, shape)


def _shape(frames: dict, eligible: dict, views: list) -> tuple | None:
    """F: the frame of the members computed in their own shape (a batch norm's channels), when
    they share one; else, of the coarsest refinement of all frames (step 2) and the frames of
    the members over rows, the one most members compute in (a layer norm's, where the
    refinement would split its rows)."""
    fixed = {frames[n] for n in frames if eligible[n] == FIXED}
    if len(fixed) == 1:
        return fixed.pop()
    fine = refinement(set(frames.values()) | {tuple(tensor_info(v).shape) for v in views})
    options = [f for f in [fine, *sorted({frames[n] for n in frames if eligible[n] == ROWS})] if f is not None]
    return max(options, key=lambda f: sum(_fits(n, frames[n], eligible[n], f) for n in frames), default=None)


def _fits(node: torch.fx.Node, frame: tuple, kind: str, shape: tuple) -> bool:
    """Whether the member computes in F: its value and the tensors it reads have forms in F, a
    member over rows keeps its last dim, one computed in its own shape has F as its frame."""
    if kind == FIXED:
        return frame == shape
    if kind == ROWS and frame[-1:] != shape[-1:]:
        return False
    values = [node, *(node.all_input_nodes[:1] if kind == ROWS else node.all_input_nodes)]
    return all(not isinstance(i := tensor_info(v), TensorInfo) or not i.shape or written_in(i.shape, frame, shape)
               is not None for v in values)


def _through(view: torch.fx.Node, joining: set) -> list:
    """The users of a reshape, and of the reshapes after it."""
    out = []
    for user in view.users:
        out += _through(user, joining) if user in joining else [user]
    return out
