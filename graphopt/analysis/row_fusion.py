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

from ..codegen.row_space import dim_order
from ..codegen.row_group import COL, FULL, INDEX, ROW, Builder, RowGroup, emit_cross_entropy, emit_layer_norm, \
    emit_log_softmax, emit_mean, emit_rms_norm, emit_softmax
from .meta import TensorInfo, dense, tensor_info

REDUCING = ("sum", "mean", "amax")
NORMALIZING = ("softmax", "log_softmax", "layer_norm", "rms_norm", "cross_entropy")
ROW_OPS = REDUCING + NORMALIZING
# aten's integer codes for a loss's reduction
REDUCTIONS = {0: "none", 1: "mean", 2: "sum", "none": "none", "mean": "mean", "sum": "sum"}
CHANNEL_NORMS = ("batch_norm", "batch_norm_train", "native_batch_norm", "native_batch_norm_train", "group_norm",
                 "native_group_norm", "instance_norm")
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


def kind_of(shape, full: tuple) -> str | None:
    """FULL, ROW or COL: the class of a value of this shape in rows of shape `full`, broadcast as
    eager broadcasts it (a mask of [B, 1, S, S] against scores of [B, H, S, S] is FULL); None when
    it does not broadcast to them."""
    shape = tuple(shape)
    if shape == full:
        return FULL
    if len(shape) > len(full):
        return None
    aligned = (1,) * (len(full) - len(shape)) + shape
    if any(s not in (1, f) for s, f in zip(aligned, full)):
        return None
    along_rows = any(s == f != 1 for s, f in zip(aligned[:-1], full[:-1]))
    if aligned[-1] == full[-1] != 1:
        return FULL if along_rows else COL
    return ROW


def exact_shape(kind: str, full: tuple) -> tuple | None:
    """The shape a node's value of this class has when a kernel stores it; None for COL (stored
    by no kernel)."""
    return {FULL: full, ROW: full[:-1] + (1,)}.get(kind)


def combined(kinds) -> str:
    """The class of an elementwise result of values of these classes."""
    kinds = set(kinds)
    if kinds == {ROW}:
        return ROW
    if kinds == {COL}:
        return COL
    return FULL


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
    """(F, operands, params) for a row member; the reason when the node's op is a row op that this
    node cannot be one of; None when its op is none."""
    if op is None or op.name not in ROW_OPS:
        return None
    if bound is None:
        return f"its arguments do not bind to {op.name}'s operands and params"
    x, info = bound.operands[0], tensor_info(node)
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
    operands = [_state(v, gm) for v in bound.operands]
    if op.name == "cross_entropy":
        reason = _cross_entropy(operands, params, full)
        if reason is not None:
            return reason
        return full, tuple(operands[:2]), {"reduction": REDUCTIONS[params["reduction"]],
                                           "ignore_index": params["ignore_index"]}
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
            if v is not None and (info_of(v) is None or info_of(v).dtype != DTYPE or kind_of(info_of(v).shape, full) != COL):
                return f"{op.name}'s weight or bias is not a float32 vector of the last dim"
        if op.name == "rms_norm" and params.get("eps") is None:
            params["eps"] = torch.finfo(DTYPE).eps  # what F.rms_norm takes for None
        if not isinstance(params.get("eps"), float):
            return f"{op.name}'s eps is not a number known when tracing"
    return full, tuple(operands), params


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
    """Why a norm over channels stays out of fused kernels; None for other ops."""
    if op is None or op.name not in CHANNEL_NORMS:
        return None
    state = " and updates its running statistics" if op.mutates else ""
    return f"{op.name} normalizes each channel over the other dims{state}; row kernels reduce the last dim only"


def emit(b: Builder, op: str, refs: list, params: dict, full: tuple):
    """The steps of a row member, its operands given as refs; returns its value's ref (a cross
    entropy's: its rows' losses)."""
    columns = full[-1]
    if op == "cross_entropy":
        return emit_cross_entropy(b, refs[0], refs[1], b.input("cols", INDEX), params["ignore_index"])
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


def fits_rows(members: list, full: tuple) -> str | None:
    """Why these members cannot all be one row group with rows of shape `full`; None when they can."""
    for m in members:
        if m.row is not None:
            if m.row != full:
                return f"{m.node.name} reduces rows of shape {list(m.row)}, the group's are {list(full)}"
            continue
        out = tensor_info(m.node)
        kinds = []
        for v in m.operands:
            info = info_of(v)
            if info is None:
                continue
            kind = kind_of(info.shape, full)
            if kind is None or info.dtype != DTYPE:
                return f"{v.name} ({info.short()}) is not a float32 row, per-row or per-column value of rows {list(full)}"
            kinds.append(kind)
        if m.identity:
            continue
        kind = combined(kinds)
        if out.dtype != DTYPE or kind_of(out.shape, full) != kind or exact_shape(kind, full) not in (None, out.shape):
            return f"{m.node.name} makes {out.short()}, not a float32 value of rows {list(full)}"
    return None


def build_rows(nodes: list[torch.fx.Node], members: dict, full: tuple):
    """A row group's (inputs, outputs, aliases, RowGroup) for these nodes, or the reason there is none."""
    inside = set(nodes)
    b, inputs, refs, aliases = Builder(), [], {}, {}

    def ref(value):
        if value is None or not isinstance(value, (torch.fx.Node, StateInput)):
            return value
        if value in inside:
            return refs[value]
        if value not in inputs:
            inputs.append(value)
            b.input(value.name, kind_of(info_of(value).shape, full))
        return ("input", inputs.index(value))

    def ref_as(value, kind):  # an input of a given class (a cross entropy's class indices: per row)
        if value not in inputs:
            inputs.append(value)
            b.input(value.name, kind)
        return ("input", inputs.index(value))

    for node in nodes:
        m = members[node]
        if m.identity:
            refs[node] = ref(m.operands[0])
        elif m.op == "cross_entropy":
            refs[node] = emit(b, m.op, [ref(m.operands[0]), ref_as(m.operands[1], ROW)], m.params, full)
        elif m.row is not None:
            refs[node] = emit(b, m.op, [ref(v) for v in m.operands], m.params, full)
        else:
            refs[node] = b(m.op, *(ref(v) for v in m.operands), **m.params)
    outputs, stored = [], []
    for node in nodes:
        if not any(user not in inside for user in node.users):
            continue
        kind, index = refs[node]
        if kind == "input":
            aliases[node] = inputs[index]
        elif index not in stored:
            stored.append(index)
            outputs.append(node)
        else:
            aliases[node] = outputs[stored.index(index)]
    if not stored:
        return "dead code: nothing outside the group uses its results"
    try:
        group = b.group(*(("step", j) for j in stored), origin=[n.name for n in nodes])
    except ValueError as e:
        return f"declined by codegen: {e}"
    orders = tuple(dim_order(tensor_info(n).shape, tensor_info(n).stride) for n in outputs)
    return inputs, outputs, aliases, group, tuple(_finish(members[n], inputs) for n in outputs), orders


def _finish(member, inputs) -> tuple | None:
    """What turns an output's rows into the node's value: a cross entropy's reduction of its rows'
    losses, ("mean" | "sum" | "none", the target's input index, ignore_index); None: as it is."""
    if member.op != "cross_entropy":
        return None
    return member.params["reduction"], inputs.index(member.operands[1]), member.params["ignore_index"]
