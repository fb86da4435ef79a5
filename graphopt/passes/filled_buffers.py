"""A fresh buffer filled piecewise becomes the concatenation of its pieces (normalize's step 12).

Models build a tensor by allocating it and copying parts into slices of it: DeepSeek-V3's
attention, `key_states = k_nope.new_empty(...)`, then `key_states[..., :d] = k_nope` and
`key_states[..., d:] = k_rot`. Export keeps this as `new_empty`, `slice` views and `copy_`
writes. Each write changes state, so recompute cuts every segment at it and can never rerun a
whole decoder layer, as the model's own checkpointing does. Where the slices tile one
dimension of an uninitialized tensor exactly, each written once by a copy of the slice's own
shape and dtype, before anything else reads the tensor, `torch.cat` of the copies' sources
along that dimension computes the same values (and the same gradients: copy_ passes each
slice's gradient to its source, cat's backward splits it the same way), with no write.
"""
from __future__ import annotations

import torch
import torch.fx

from .. import ops
from ..analysis import meta
from ..codegen.layout import contiguous_strides

EMPTY = ("empty", "empty_like", "new_empty")  # uninitialized: every value comes from the copies


def cat_filled_buffers(gm: torch.fx.GraphModule) -> int:
    """Rewrite each buffer filled piecewise; the number rewritten."""
    done = 0
    for x in list(gm.graph.nodes):
        if _name(x, gm) not in EMPTY:
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}  # after the rewrites before this one
        pieces = _pieces(x, gm, order)
        if pieces is None:
            continue
        dim, writes = pieces  # each write: (the copy_, the slice it writes, its source)
        last = max((w for w, _, _ in writes), key=order.__getitem__)
        with gm.graph.inserting_after(last):
            cat = gm.graph.call_function(torch.ops.aten.cat.default, ([src for _, _, src in writes], dim))
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):  # the module it is in, for dumps and blocks
            if key in last.meta:
                cat.meta[key] = last.meta[key]
        views = {view for _, view, _ in writes}
        for user in list(x.users):
            if user not in views:
                user.replace_input_with(x, cat)
        for write, view, _ in writes:
            gm.graph.erase_node(write)
            gm.graph.erase_node(view)
        gm.graph.erase_node(x)
        done += 1
    if done:
        gm.recompile()
    return done


def _name(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str | None:
    op = ops.lookup(node, gm) if node.op.startswith("call") else None
    return op.name if op is not None else None


def _pieces(x: torch.fx.Node, gm: torch.fx.GraphModule, order: dict):
    """(dim, [(copy_, slice, source)] in slice order) when x is filled as the module docstring
    says; None otherwise."""
    value = meta.tensor_info(x)
    if not isinstance(value, meta.TensorInfo) or value.stride != contiguous_strides(value.shape):
        return None
    views = [u for u in x.users if _name(u, gm) == "slice"]
    reads = [u for u in x.users if u not in views]
    spans, dims = {}, set()
    for view in views:
        bound, users = ops.bind(view, gm), list(view.users)
        write = users[0] if len(users) == 1 and _name(users[0], gm) == "copy_" and not users[0].users else None
        copied = ops.bind(write, gm) if write is not None else None
        if bound is None or copied is None or copied.operands[0] is not view or copied.params.get("non_blocking"):
            return None
        source, (dim, start, end, step) = copied.operands[1], (bound[k] for k in ("dim", "start", "end", "step"))
        got, want = meta.tensor_info(source), meta.tensor_info(view)
        if not isinstance(got, meta.TensorInfo) or not isinstance(want, meta.TensorInfo) or _kind(got) != _kind(want):
            return None  # a copy that broadcasts or casts: cat would need its own expand and cast
        size = value.shape[dim % len(value.shape)] if isinstance(dim, int) else None
        start = 0 if start is None else start
        if step != 1 or not isinstance(size, int) or not isinstance(start, int) \
                or not (end is None or isinstance(end, int)):
            return None
        spans[(write, view, source)] = (start, size if end is None else min(end, size))
        dims.add(dim % len(value.shape))
    if len(dims) != 1:
        return None
    dim = dims.pop()
    writes = sorted(spans, key=spans.__getitem__)
    covered = 0
    for w in writes:
        start, end = spans[w]
        if start != covered or end <= start:
            return None  # a gap or an overlap: the tensor's values are not the pieces alone
        covered = end
    if covered != value.shape[dim]:
        return None
    if any(order[r] < order[w] for r in reads for w, _, _ in writes):
        return None  # something reads the buffer before it is whole
    return dim, writes


def _kind(info: meta.TensorInfo) -> tuple:
    return info.shape, info.dtype, info.device
