"""The row program a row group runs (an analysis: it reads the graph, never mutates): its members'
steps (row_members.py says which nodes they are), its inputs, outputs and what its fused call
does besides (a cross-entropy's reduction of its rows, a batch norm's running statistics).

An elementwise node joins a row group only when each of its tensors has a class in the group's
rows and its result has the class its operands' classes make (ROW with COL is FULL, as
broadcasting makes it), at the shape a kernel stores (F for FULL, F with 1 at the columns for
ROW); that is the whole rule, checked at every merge (fits_rows). A row group's kernels read and
write tensors in eager's layout (codegen/row_space.py), so a node eager makes transposed may
join one, where an elementwise group, which writes contiguous tensors, leaves it out.
"""
from __future__ import annotations

import torch
import torch.fx

from ...analysis.meta import tensor_info
from ...codegen.row_group import COL, FULL, INDEX, ROW, Builder, combined, emit_cross_entropy, emit_layer_norm, \
    emit_log_softmax, emit_mean, emit_rms_norm, emit_softmax
from ...codegen.row_space import RowSpace, dim_order
from .dropout_members import DrawnMask, emit_bernoulli, emit_dropout
from .epilogue_members import BiasFree
from .group_outputs import group_outputs
from .row_members import BATCH_NORMS, DTYPE, FLOATS, PIECE, ROW_OPS, StateInput, exact_shape, info_of, kind_of

# members whose eager backward is one kernel computing in float32: their last step's terms are not rounded
ONE_KERNEL = ("layer_norm", "rms_norm", *BATCH_NORMS)


def emit_batch_norm(b: Builder, refs: list, params: dict, columns: int):
    """(y, the batch mean, the batch variance, biased), the statistics None in eval."""
    x, weight, bias, mean, var = refs
    if params["training"]:
        mean = emit_mean(b, x, columns)
        centered = b("sub", x, mean)
        var = emit_mean(b, b("mul", centered, centered), columns)
    else:
        centered = b("sub", x, mean)
    y = b("mul", centered, b("rsqrt", b("add", var, params["eps"])))
    y = y if weight is None else b("mul", y, weight)
    y = y if bias is None else b("add", y, bias)
    return (y, mean, var) if params["training"] else (y, None, None)


def emit(b: Builder, op: str, refs: list, params: dict, rows: RowSpace, index):
    """The steps of a row member, its operands given as refs (index() gives the column index's);
    returns its value's ref (a cross entropy's: its rows' losses)."""
    columns = rows.columns
    if op == "cross_entropy":
        return emit_cross_entropy(b, refs[0], refs[1], index(), params["ignore_index"])
    if op == "sum":
        return b("row_sum", refs[0])
    if op == "mean":
        return emit_mean(b, refs[0], columns)
    if op == "amax":
        return b("row_max", refs[0])
    if op == "softmax":
        return emit_softmax(b, refs[0])
    if op == "log_softmax":
        return emit_log_softmax(b, refs[0])
    if op == "layer_norm":
        return emit_layer_norm(b, refs[0], refs[1], refs[2], columns, params["eps"])
    return emit_rms_norm(b, refs[0], refs[1], columns, params["eps"])


def channel_vectors(members: list) -> set:
    """The elementwise members that compute a batch norm's weight or bias in the group (NFNet's
    gain * scale): their values are vectors of the channels, per row whatever their shape says,
    used by nothing but the norms' weights and biases and one another."""
    norms = [m for m in members if m.op in BATCH_NORMS]
    if not norms:
        return set()
    channels = norms[0].row.shape[1]

    def vector(info):  # [C], [C, 1, 1, 1] or a 0-dim scalar
        return info is None or (info.dtype == DTYPE and [s for s in info.shape if s != 1] in ([channels], [])
                                and (not info.shape or info.shape[0] == channels))
    held = {m.node: m for m in members}
    found = {m.node for m in members if m.row is None and m.mask is None and not m.epilogue
             and tensor_info(m.node).shape[:1] == (channels,) and vector(tensor_info(m.node))
             and all(vector(info_of(v)) for v in m.operands)}
    changed = True
    while changed:  # keep those whose every use is a norm's weight or bias, or one of them
        kept = {n for n in found if all(u in found or (u in held and held[u].op in BATCH_NORMS and n in held[u].operands[1:3]
                                                        and n is not held[u].operands[0]) for u in n.users)}
        changed, found = kept != found, kept
    return found


def fits_rows(members: list, rows: RowSpace) -> str | None:
    """Why these members cannot all be one row group in these rows; None when they can."""
    where = f"rows of {list(rows.shape)}" + ("" if rows.col_dims == (len(rows.shape) - 1,) else
                                              f" over dims {list(rows.col_dims)}")
    vectors = channel_vectors(members)
    for m in members:
        if m.row is not None:
            if m.row != rows:
                return f"{m.node.name} reduces rows of {list(m.row.shape)} over dims {list(m.row.col_dims)}, the group's are {where}"
            continue
        if m.node in vectors:
            continue
        out = tensor_info(m.node)
        kinds = []
        for v in m.operands:
            info = info_of(v)
            if info is None:
                continue
            kind = kind_of(info.shape, rows)
            if kind is None or info.dtype not in FLOATS:
                return f"{v.name} ({info.short()}) is not a float row, per-row or per-column value of {where}"
            kinds.append(kind)
        if m.identity:
            continue
        kind = combined(kinds)
        if m.op == "bernoulli":  # no operand: its value has its mask's shape
            kind = kind_of(out.shape, rows)
            if kind is None:
                return f"{m.node.name} draws noise of {out.short()}, not a value of {where}"
        elif m.mask is not None and kind != FULL:
            return f"{m.node.name} drops out a {kind.lower()} value of {where}: a mask has the rows' shape"
        if out.dtype not in FLOATS or kind_of(out.shape, rows) != kind or exact_shape(kind, rows) not in (None, out.shape):
            return f"{m.node.name} makes {out.short()}, not a float value of {where}"
    return None


def build_rows(nodes: list[torch.fx.Node], members: dict, rows: RowSpace):
    """A row group's (inputs, outputs, aliases, RowGroup, finish, orders, updates) for these nodes
    (members and the nodes they absorb), or the reason there is none. inputs are the graph values
    the fused call takes: the RowGroup's inputs but its column index, in order (a value read
    shifted is taken once more), then the state it updates. updates, per batch norm in training
    with running statistics: (its batch mean's and variance's RowGroup outputs, after the graph's;
    running mean, running variance and batch count (or None) as places in that state; momentum)."""
    inside = set(nodes)
    b, slots, refs = Builder(), [], {}  # slots: per RowGroup input, its value (None: the column index)
    updates = []  # a batch norm's running statistics: (batch mean ref, variance ref, their places in state, momentum)
    state = []  # what the fused call writes but its kernels do not read: running statistics, batch counts

    def slot(value, kind, shift=0):
        key = (value, kind, shift)
        if key not in refs:
            slots.append(value)
            info = None if value is None else info_of(value)
            dtype = info.dtype if info is not None and info.dtype in FLOATS else torch.float32  # else: indices, masks
            refs[key] = b.input("cols" if value is None else value.name, kind, shift, dtype)
        return refs[key]

    def ref(value):
        if value is None or not isinstance(value, (torch.fx.Node, StateInput, BiasFree)):
            return value
        if value in inside:
            return refs[value]
        return slot(value, kind_of(info_of(value).shape, rows))

    def columns():
        return slot(None, INDEX)

    vectors = channel_vectors([members[n] for n in nodes if n in members])

    def per_row(value):  # a batch norm's vector of the channels, given or computed in the group
        return refs[value] if value in inside else slot(value, ROW)

    for node in nodes:
        m = members.get(node)
        if m is None:  # absorbed by a member after it
            continue
        since = len(b.steps)  # the member's own steps: its last is made in its node's dtype
        if m.identity:
            refs[node] = ref(m.operands[0])
        elif m.op == "cross_entropy":  # its class indices are per row, whatever their shape says
            refs[node] = emit(b, m.op, [ref(m.operands[0]), slot(m.operands[1], ROW)], m.params, rows, columns)
        elif m.op == "cat":
            refs[node] = _rotation(b, m, ref, slot, columns)
        elif m.op in BATCH_NORMS:  # its per-channel vectors are per row, whatever their shape says
            training = m.params["training"]
            read = m.operands[1:3] if training else m.operands[1:]  # training reads no running statistics
            per_channel = [None if v is None else per_row(v) for v in read] + [None, None] * training
            y, mean, var = emit_batch_norm(b, [ref(m.operands[0]), *per_channel], m.params, rows.columns)
            refs[node] = y
            if training and m.operands[3] is not None:
                written = [m.operands[3], m.operands[4], m.params["count"]]
                state += [v for v in written if v is not None]
                at = [None if v is None else state.index(v) for v in written]
                updates.append((mean, var, *at, m.params["momentum"]))
        elif m.epilogue:  # a convolution's bias is per channel, a row of its rows, whatever its shape says
            bias = m.operands[1]
            refs[node] = b("add", ref(m.operands[0]), slot(bias, ROW) if m.epilogue == ROW else ref(bias))
        elif m.op == "bernoulli":
            refs[node] = emit_bernoulli(b, slot(m.mask, kind_of(m.mask.info.shape, rows)), m.mask.dtype)
        elif m.mask is not None:
            refs[node] = emit_dropout(b, ref(m.operands[0]), slot(m.mask, FULL), m.mask.keep, m.mask.dtype)
        elif m.op in ("layer_norm", "rms_norm"):  # its weight and bias are per column, whatever their shape says
            refs[node] = emit(b, m.op, [ref(m.operands[0]), *(None if v is None else slot(v, COL) for v in m.operands[1:])],
                              m.params, rows, columns)
        elif m.op in ROW_OPS:
            x, *rest = [ref(v) for v in m.operands]
            if m.params.get("dtype") is not None and m.params["dtype"] != info_of(m.operands[0]).dtype:
                x = b("to_dtype", x, dtype=m.params["dtype"])  # sum(dtype=...), softmax(dtype=...): cast first
                b.made_in(x, m.params["dtype"], since)
            refs[node] = emit(b, m.op, [x, *rest], m.params, rows, columns)
        elif node in vectors:
            refs[node] = b(m.op, *(per_row(v) if isinstance(v, torch.fx.Node) else v for v in m.operands), **m.params)
        else:
            refs[node] = b(m.op, *(ref(v) for v in m.operands), **m.params)
        b.made_in(refs[node], tensor_info(node).dtype, since, one_kernel=m.op in ONE_KERNEL)
    outputs, stored, aliases = group_outputs(nodes, refs, slots, lambda node: node in members)
    if not stored:
        return "dead code: nothing outside the group uses its results"
    masks = [isinstance(v, DrawnMask) and v.shape_of is None for v in slots]
    if any(masks) and not any(v is not None and not mask and b.inputs[k].kind == FULL
                              for k, (v, mask) in enumerate(zip(slots, masks))):
        return "its dropout masks would be its only full-size inputs: the call takes their shape from the others"
    # the batch statistics are outputs the fused call keeps to itself, after the graph's
    side = [ref for mean, var, *_ in updates for ref in (mean, var)]
    try:
        group = b.group(*(("step", j) for j in stored), *side, origin=[n.name for n in nodes])
    except ValueError as e:
        return f"declined by codegen: {e}"
    orders = tuple(dim_order(tensor_info(n).shape, tensor_info(n).stride) for n in outputs)
    finish = tuple(_finish(members[n], refs) for n in outputs)
    updates = tuple((len(stored) + 2 * i, len(stored) + 2 * i + 1, *written)
                    for i, (_, _, *written) in enumerate(updates))
    return [v for v in slots if v is not None] + state, outputs, aliases, group, finish, orders, updates


def _finish(member, refs) -> tuple | None:
    """What turns an output's rows into the node's value: a cross entropy's reduction of its rows'
    losses, ("mean" | "sum" | "none", its class indices' RowGroup input, ignore_index); None: as it is."""
    if member.op != "cross_entropy":
        return None
    return member.params["reduction"], refs[(member.operands[1], ROW, 0)][1], member.params["ignore_index"]


def _rotation(b: Builder, m, ref, slot, columns):
    """A cat of column slices of one value (rotary's rotate_half): each piece is the value read
    shifted, through its chain of elementwise ops; the column index picks the piece."""
    x = m.operands[0]
    pieces = []
    for start, shift, chain in m.params["pieces"]:
        value = ref(x) if shift == 0 else slot(x, FULL, shift)
        for op, args, params in chain:
            value = b(op, *(value if a is PIECE else a for a in args), **params)
        pieces.append((start, value))
    value = pieces[-1][1]
    for (_, piece), (start, _) in zip(reversed(pieces[:-1]), reversed(pieces[1:])):
        value = b("where", b("lt", columns(), float(start)), piece, value)
    return value
