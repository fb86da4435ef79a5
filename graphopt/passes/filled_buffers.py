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

from ..analysis import meta

aten = torch.ops.aten
EMPTY = (aten.new_empty.default, aten.empty.memory_format, aten.empty_like.default)
COPY = aten.copy_.default
SLICE = aten.slice.Tensor


def cat_filled_buffers(gm: torch.fx.GraphModule) -> int:
    """Rewrite each buffer filled piecewise; the number rewritten."""
    done = 0
    for x in list(gm.graph.nodes):
        if x.op != "call_function" or x.target not in EMPTY:
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}  # after the rewrites before this one
        pieces = _pieces(x, order)
        if pieces is None:
            continue
        dim, writes = pieces
        last = max(writes, key=order.__getitem__)
        with gm.graph.inserting_after(last):
            cat = gm.graph.call_function(aten.cat.default, ([w.args[1] for w in writes], dim))
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):  # the module it is in, for dumps and blocks
            if key in last.meta:
                cat.meta[key] = last.meta[key]
        for user in list(x.users):
            if user.target is not SLICE:
                user.replace_input_with(x, cat)
        for w in writes:
            view = w.args[0]
            gm.graph.erase_node(w)
            gm.graph.erase_node(view)
        gm.graph.erase_node(x)
        done += 1
    if done:
        gm.recompile()
    return done


def _pieces(x: torch.fx.Node, order: dict):
    """(dim, the copy_ nodes in slice order) when x is filled as the module docstring says; None
    otherwise."""
    value = meta.tensor_info(x)
    if not isinstance(value, meta.TensorInfo) or value.stride != _contiguous(value.shape):
        return None
    views = [u for u in x.users if u.target is SLICE]
    reads = [u for u in x.users if u.target is not SLICE]
    if not views:
        return None
    spans, dims = {}, set()
    for view in views:
        dim, start, end, step = (list(view.args[1:]) + [0, None, None, 1][len(view.args) - 1:])[:4]
        start = 0 if start is None else start
        users = list(view.users)
        if view.kwargs or step != 1 or len(users) != 1 or users[0].target is not COPY or users[0].args[0] is not view \
                or users[0].users or len(users[0].args) != 2 or users[0].kwargs.get("non_blocking"):
            return None
        write, source = users[0], users[0].args[1]
        got, want = meta.tensor_info(source), meta.tensor_info(view)
        if not isinstance(source, torch.fx.Node) or not isinstance(got, meta.TensorInfo) \
                or not isinstance(want, meta.TensorInfo) or _kind(got) != _kind(want):
            return None  # a copy that broadcasts or casts: cat would need its own expand and cast
        size = value.shape[dim % len(value.shape)] if isinstance(dim, int) else None
        if not isinstance(size, int) or not isinstance(start, int) or not (end is None or isinstance(end, int)):
            return None
        spans[write] = (start, size if end is None else min(end, size))
        dims.add(dim % len(value.shape))
    if len(dims) != 1:
        return None
    writes = sorted(spans, key=lambda w: spans[w])
    covered = 0
    for w in writes:
        start, end = spans[w]
        if start != covered or end <= start:
            return None  # a gap or an overlap: the tensor's values are not the pieces alone
        covered = end
    if covered != value.shape[dims.copy().pop()]:
        return None
    if any(order[r] < order[w] for r in reads for w in writes):
        return None  # something reads the buffer before it is whole
    return dims.pop(), writes


def _kind(info: meta.TensorInfo) -> tuple:
    return info.shape, info.dtype, info.device


def _contiguous(shape) -> tuple:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(out))
