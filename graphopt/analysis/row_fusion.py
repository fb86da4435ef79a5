"""Reductions over the last dim in fused groups: which nodes are row members, and the row program a
group holding one runs (an analysis: it reads the graph, never mutates).

A row member reduces or normalizes each row of its input's last dim: sum, mean and amax over
dim -1 with keepdim, softmax and log_softmax over dim -1, layer_norm and rms_norm over the last
dim alone, cross_entropy of [N, C] logits with [N] class indices (no class weights, no label
smoothing: its rows' losses, then their mean or sum); in float32, the dtype the row kernels take
(codegen/row_group.py). A group that holds one is a row group.

Every value in a row group has a class relative to the shape F = [..., C] of the rows (the row
member's input), as eager broadcasts it against F: FULL when it varies along the columns and
some row dim (F itself, or a mask of [B, 1, S, S] against scores of [B, H, S, S]), COL when only
along the columns ([C]: a norm's weight), ROW otherwise ([..., 1]: a row's statistic). An
elementwise node joins a row group only when each of its tensors has a class and its result has
the class its operands' classes make (ROW with COL is FULL, as broadcasting makes it), at the
shape a kernel stores (F for FULL, F[:-1] + [1] for ROW); that is the whole rule, checked at
every merge (fits_rows). A row group's kernels read and write tensors in eager's layout
(codegen/row_space.py), so a node eager makes transposed may join one, where an elementwise
group, which writes contiguous tensors, leaves it out.

A norm's weight and bias may be a leaf module's parameters, which are no graph nodes: they are
StateInputs, which the fuse pass reads with a get_attr node.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..codegen.row_space import RowSpace, dim_order
from ..codegen.row_group import COL, FULL, INDEX, ROW, Builder, combined, emit_cross_entropy, emit_layer_norm, \
    emit_log_softmax, emit_mean, emit_rms_norm, emit_softmax
from .. import ops
from .group_outputs import group_outputs
from .meta import TensorInfo, dense, tensor_info

REDUCING = ("sum", "mean", "amax")
NORMALIZING = ("softmax", "log_softmax", "layer_norm", "rms_norm", "cross_entropy")
BATCH_NORMS = ("batch_norm", "batch_norm_train")
ROW_OPS = REDUCING + NORMALIZING + BATCH_NORMS + ("cat",)
PIECE = object()  # in a rotation's chain of ops: where the piece's value goes
INT64_MAX = 2**63 - 1  # aten.slice's end for "to the end"
# aten's integer codes for a loss's reduction
REDUCTIONS = {0: "none", 1: "mean", 2: "sum", "none": "none", "mean": "mean", "sum": "sum"}
CHANNEL_NORMS = ("native_batch_norm", "native_batch_norm_train", "group_norm", "native_group_norm", "instance_norm")
DTYPE = torch.float32


@dataclass(frozen=True)
class StateInput:
    """A parameter or buffer that is no graph node (a leaf module's weight), by qualified name."""

    target: str
    info: TensorInfo

    @property
    def name(self) -> str:
        return self.target.replace(".", "_")


def info_of(value) -> TensorInfo | None:
    if isinstance(value, StateInput):
        return value.info
    if isinstance(value, torch.fx.Node):
        info = tensor_info(value)
        return info if isinstance(info, TensorInfo) else None
    return None


def kind_of(shape, rows: RowSpace) -> str | None:
    """FULL, ROW or COL: the class of a value of this shape in these rows, broadcast as eager
    broadcasts it (a mask of [B, 1, S, S] against scores of [B, H, S, S] is FULL); None when it
    does not broadcast to them."""
    shape, full = tuple(shape), rows.shape
    if shape == full:
        return FULL
    if len(shape) > len(full):
        return None
    aligned = (1,) * (len(full) - len(shape)) + shape
    if any(s not in (1, f) for s, f in zip(aligned, full)):
        return None
    along_rows = any(aligned[d] == full[d] != 1 for d in rows.row_dims)
    if any(aligned[d] == full[d] != 1 for d in rows.col_dims):
        return FULL if along_rows else COL
    return ROW


def exact_shape(kind: str, rows: RowSpace) -> tuple | None:
    """The shape a node's value of this class has when a kernel stores it; None for COL (stored
    by no kernel)."""
    return {FULL: rows.shape, ROW: rows.row_shape()}.get(kind)


def _dim_is_last(dim, rank: int) -> bool:
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and not isinstance(dim, bool) and dim in (-1, rank - 1)


def _state(value, gm: torch.fx.GraphModule):
    """A leaf module's Parameter as a StateInput; graph nodes and None as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    for qualified, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        if t is value:
            return StateInput(qualified, TensorInfo.of(t))
    return value


def row_member(node: torch.fx.Node, gm: torch.fx.GraphModule, op, bound) -> tuple | str | None:
    """(F, operands, params, the nodes it absorbs) for a row member; the reason when the node's op
    is a row op that this node cannot be one of; None when its op is none."""
    if op is None or op.name not in ROW_OPS:
        return None
    if bound is None:
        return f"its arguments do not bind to {op.name}'s operands and params"
    x, info = bound.operands[0], tensor_info(node)
    if op.name == "cat":
        x = x[0] if isinstance(x, (list, tuple)) and x else None
    xinfo = info_of(x)
    if not isinstance(info, TensorInfo) or xinfo is None:
        return "no tensor metadata (annotate the graph first)"
    if (op.name != "cross_entropy" and info.dtype != DTYPE) or xinfo.dtype != DTYPE:
        return f"{op.name} in {info.dtype}: row kernels compute float32 tensors"
    full, params = xinfo.shape, dict(bound.params)
    if len(full) < 2 or full[-1] < 2:
        return f"rows of shape {list(full)}: a row kernel reduces a last dim of 2 or more over leading dims"
    if op.name != "cross_entropy" and not dense(info):
        return f"eager makes it with strides {info.stride}, overlapping or with gaps; a fused kernel writes dense tensors"
    if op.name == "cat":
        return _rotation_member(node, gm, bound, info)
    operands = [_state(v, gm) for v in bound.operands]
    if op.name in BATCH_NORMS:
        return _batch_norm_member(node, gm, operands, params, xinfo)
    rows = RowSpace.last(full)
    if op.name == "cross_entropy":
        reason = _cross_entropy(operands, params, full)
        if reason is not None:
            return reason
        return rows, tuple(operands[:2]), {"reduction": REDUCTIONS[params["reduction"]],
                                           "ignore_index": params["ignore_index"]}, ()
    if op.name in REDUCING:
        if not _dim_is_last(params.get("dim"), len(full)) or params.get("keepdim") is not True \
                or params.get("dtype") not in (None, DTYPE):
            return f"{op.name} over dim {params.get('dim')} (keepdim={params.get('keepdim')}): row kernels " \
                   "reduce the last dim, keeping it"
    elif op.name in ("softmax", "log_softmax"):
        if not _dim_is_last(params.get("dim"), len(full)) or params.get("dtype") not in (None, DTYPE):
            return f"{op.name} over dim {params.get('dim')}: row kernels normalize the last dim"
    else:
        shape = params.get("normalized_shape")
        if not isinstance(shape, (list, tuple)) or tuple(shape) != full[-1:]:
            return f"{op.name} over {shape}: row kernels normalize the last dim alone"
        for v in operands[1:]:
            if v is not None and (info_of(v) is None or info_of(v).dtype != DTYPE or kind_of(info_of(v).shape, rows) != COL):
                return f"{op.name}'s weight or bias is not a float32 vector of the last dim"
        if op.name == "rms_norm" and params.get("eps") is None:
            params["eps"] = torch.finfo(DTYPE).eps  # what F.rms_norm takes for None
        if not isinstance(params.get("eps"), float):
            return f"{op.name}'s eps is not a number known when tracing"
    return rows, tuple(operands), params, ()


def column_slice(node: torch.fx.Node, gm: torch.fx.GraphModule):
    """(x, first column, width) when the node takes a run of x's last dim whole along the others
    (x[..., a:b], aten.slice, narrow); None otherwise."""
    op, bound, info = ops.lookup(node, gm), ops.bind(node, gm), tensor_info(node)
    if op is None or bound is None or not isinstance(info, TensorInfo) or not info.shape:
        return None
    x = bound.operands[0]
    xinfo = info_of(x)
    if xinfo is None or len(xinfo.shape) != len(info.shape) or xinfo.shape[:-1] != info.shape[:-1]:
        return None
    width, columns, params = info.shape[-1], xinfo.shape[-1], bound.params
    if op.name == "slice":
        if not _dim_is_last(params["dim"], len(info.shape)) or params["step"] != 1:
            return None
        start, end = params["start"], params["end"]
    elif op.name == "narrow":
        if not _dim_is_last(params["dim"], len(info.shape)):
            return None
        start, end = params["start"], None
    elif op.name in ("getitem", "getitem_index"):  # a view by basic indexing, or by tensors
        index = params["index"]
        index = index if isinstance(index, tuple) else (index,)
        last = index[-1] if index and isinstance(index[-1], slice) else None
        leading = index[:-1]
        if last is None or last.step not in (None, 1) or not (leading in ((Ellipsis,), ()) or (
                len(leading) == len(info.shape) - 1 and all(i == slice(None) for i in leading))):
            return None
        start, end = last.start, last.stop
    else:
        return None
    if end == INT64_MAX:
        end = None
    # bounds computed at run time (x.shape[-1] // 2) are known from the slice's width when the other end is open
    if isinstance(start, torch.fx.Node):
        start = columns - width if end is None else None
    elif start is None:
        start = 0
    if not isinstance(start, int) or start < 0 or start + width > columns:
        return None
    return x, start, width


def _rotation_member(node: torch.fx.Node, gm: torch.fx.GraphModule, bound, info) -> tuple | str:
    """A cat along the last dim of column slices of one value x (each through a chain of one-tensor
    elementwise ops), as wide as x: rotary's rotate_half, cat(-x[..., h:], x[..., :h]). The slices
    and chains are absorbed: the row program reads x shifted (codegen/row_group.py)."""
    tensors = bound.operands[0]
    if not _dim_is_last(bound.params.get("dim"), len(info.shape)) or not isinstance(tensors, (list, tuple)):
        return "cat along a dim other than the last"
    pieces, absorbed, source, start = [], [], None, 0
    for piece in tensors:
        chain, v = [], piece
        while isinstance(v, torch.fx.Node) and len(v.users) == 1:
            step = _chain_step(v, gm)
            if step is None:
                break
            chain.insert(0, step[0])
            absorbed.append(v)
            v = step[1]
        found = column_slice(v, gm) if isinstance(v, torch.fx.Node) and len(v.users) == 1 else None
        if found is None or (source is not None and found[0] is not source):
            return "cat of values other than column slices of one value"
        source = found[0]
        absorbed.append(v)
        pieces.append((start, found[1] - start, tuple(chain)))
        start += tensor_info(piece).shape[-1]
    xinfo = info_of(source)
    if xinfo.shape != info.shape or xinfo.dtype != DTYPE:
        return "cat of column slices into a value of another shape or dtype"
    return RowSpace.last(info.shape), (source,), {"pieces": tuple(pieces)}, tuple(absorbed)


def _chain_step(node: torch.fx.Node, gm: torch.fx.GraphModule):
    """(op, args with PIECE for the tensor, params) and the tensor, for an elementwise node of one
    float32 tensor operand and Python scalars; None otherwise."""
    op, bound, info = ops.lookup(node, gm), ops.bind(node, gm), tensor_info(node)
    if op is None or op.kind != "elementwise" or op.triton is None or bound is None or \
            not isinstance(info, TensorInfo) or info.dtype != DTYPE:
        return None
    tensors = [v for v in bound.operands if isinstance(v, torch.fx.Node)]
    if len(tensors) != 1 or not isinstance(tensor_info(tensors[0]), TensorInfo) or tensor_info(tensors[0]).shape != info.shape:
        return None
    args = tuple(PIECE if v is tensors[0] else v for v in bound.operands)
    return (op.name, args, dict(bound.params)), tensors[0]


def _cross_entropy(operands, params, full) -> str | None:
    """Why this cross_entropy is no row member; None when it is one."""
    target = info_of(operands[1])
    if len(full) != 2:
        return f"cross_entropy over logits of shape {list(full)}: row kernels take [N, C] logits"
    if target is None or target.dtype not in (torch.int64, torch.int32) or target.shape != full[:1]:
        return "cross_entropy's target is not one class index per row"
    if len(operands) > 2 and operands[2] is not None:
        return "cross_entropy with class weights"
    if params.get("label_smoothing", 0.0) != 0.0:
        return "cross_entropy with label smoothing"
    if params.get("reduction") not in REDUCTIONS or not isinstance(params.get("ignore_index"), int):
        return f"cross_entropy with reduction {params.get('reduction')!r}"
    return None


def channel_norm(op) -> str | None:
    """Why a norm over channels other than batch_norm stays out of fused kernels; None for other ops."""
    if op is None or op.name not in CHANNEL_NORMS:
        return None
    return f"{op.name} normalizes channels in groups or per sample; row kernels take batch norm's channels only"


def _batch_norm_member(node: torch.fx.Node, gm: torch.fx.GraphModule, operands, params, xinfo) -> tuple | str:
    """Batch norm as rows: one row per channel (dim 1), its columns over the other dims. In
    training it normalizes by the channel's batch statistics and, with running statistics, the
    fused call updates them as eager does (an nn.BatchNorm module also counts the batch in
    num_batches_tracked); in eval it normalizes by the running statistics."""
    _, weight, bias, mean, var = operands
    rank = len(xinfo.shape)
    rows = RowSpace(xinfo.shape, tuple(d for d in range(rank) if d != 1))
    for v in (weight, bias, mean, var):
        if v is not None and (info_of(v) is None or info_of(v).dtype != DTYPE or info_of(v).shape != (xinfo.shape[1],)):
            return "batch_norm's weight, bias or running statistics are not float32 vectors of the channels"
    training, momentum, eps = params.get("training"), params.get("momentum"), params.get("eps")
    if not isinstance(training, bool) or not isinstance(eps, float):
        return "batch_norm's training flag or eps is not known when tracing"
    if not training and (mean is None or var is None):
        return "batch_norm in eval without running statistics"
    if training and mean is not None and not isinstance(momentum, float):
        return "batch_norm with a cumulative moving average (momentum=None)"
    count = None
    if training and mean is not None and node.op == "call_module":
        module = gm.get_submodule(node.target)
        if getattr(module, "num_batches_tracked", None) is not None:
            count = _state(module.num_batches_tracked, gm)
    return rows, (operands[0], weight, bias, mean, var), {"training": training, "momentum": momentum, "eps": eps,
                                                          "count": count}, ()


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


def fits_rows(members: list, rows: RowSpace) -> str | None:
    """Why these members cannot all be one row group in these rows; None when they can."""
    where = f"rows of {list(rows.shape)}" + ("" if rows.col_dims == (len(rows.shape) - 1,) else
                                              f" over dims {list(rows.col_dims)}")
    for m in members:
        if m.row is not None:
            if m.row != rows:
                return f"{m.node.name} reduces rows of {list(m.row.shape)} over dims {list(m.row.col_dims)}, the group's are {where}"
            continue
        out = tensor_info(m.node)
        kinds = []
        for v in m.operands:
            info = info_of(v)
            if info is None:
                continue
            kind = kind_of(info.shape, rows)
            if kind is None or info.dtype != DTYPE:
                return f"{v.name} ({info.short()}) is not a float32 row, per-row or per-column value of {where}"
            kinds.append(kind)
        if m.identity:
            continue
        kind = combined(kinds)
        if out.dtype != DTYPE or kind_of(out.shape, rows) != kind or exact_shape(kind, rows) not in (None, out.shape):
            return f"{m.node.name} makes {out.short()}, not a float32 value of {where}"
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
            refs[key] = b.input("cols" if value is None else value.name, kind, shift)
        return refs[key]

    def ref(value):
        if value is None or not isinstance(value, (torch.fx.Node, StateInput)):
            return value
        if value in inside:
            return refs[value]
        return slot(value, kind_of(info_of(value).shape, rows))

    def columns():
        return slot(None, INDEX)

    for node in nodes:
        m = members.get(node)
        if m is None:  # absorbed by a member after it
            continue
        if m.identity:
            refs[node] = ref(m.operands[0])
        elif m.op == "cross_entropy":  # its class indices are per row, whatever their shape says
            refs[node] = emit(b, m.op, [ref(m.operands[0]), slot(m.operands[1], ROW)], m.params, rows, columns)
        elif m.op == "cat":
            refs[node] = _rotation(b, m, ref, slot, columns)
        elif m.op in BATCH_NORMS:  # its per-channel vectors are per row, whatever their shape says
            training = m.params["training"]
            read = m.operands[1:3] if training else m.operands[1:]  # training reads no running statistics
            per_channel = [None if v is None else slot(v, ROW) for v in read] + [None, None] * training
            y, mean, var = emit_batch_norm(b, [ref(m.operands[0]), *per_channel], m.params, rows.columns)
            refs[node] = y
            if training and m.operands[3] is not None:
                written = [m.operands[3], m.operands[4], m.params["count"]]
                state += [v for v in written if v is not None]
                at = [None if v is None else state.index(v) for v in written]
                updates.append((mean, var, *at, m.params["momentum"]))
        elif m.op in ROW_OPS:
            refs[node] = emit(b, m.op, [ref(v) for v in m.operands], m.params, rows, columns)
        else:
            refs[node] = b(m.op, *(ref(v) for v in m.operands), **m.params)
    outputs, stored, aliases = group_outputs(nodes, refs, slots, lambda node: node in members)
    if not stored:
        return "dead code: nothing outside the group uses its results"
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
