"""Which nodes a row group may hold (an analysis: it reads the graph, never mutates): the row ops,
and the class of every value in a group's rows.

A row member reduces or normalizes rows: sum, mean and amax over dim -1 with keepdim, softmax
and log_softmax over dim -1, layer_norm and rms_norm over the last dim alone, cross_entropy of
[N, C] logits with [N] class indices (no class weights, no label smoothing: its rows' losses,
then their mean or sum), batch norm (a row per channel, its columns over the other dims), and
rotary embeddings' cat of column slices of one value (the slices and the ops on them absorbed);
in float32, bfloat16 or float16 (codegen/row_group.py rounds each value as eager does), but
cross_entropy and batch norm, which take float32. A float32 elementwise node that eager lays
out strided (fusion.py) takes rows over its layout.

Every value in a row group has a class relative to its rows (codegen/row_space.py: the shape F
and the dims that make the columns), as eager broadcasts it against F: FULL when it varies along
the columns and some row dim (F itself, or a mask of [B, 1, S, S] against scores of
[B, H, S, S]), COL when only along the columns ([C]: a norm's weight), ROW otherwise ([..., 1]:
a row's statistic). A norm's weight and bias may be a leaf module's parameters, which are no
graph nodes: they are StateInputs, which the fuse pass reads with a get_attr node.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ... import ops
from ...analysis.meta import TensorInfo, dense, tensor_info
from ...codegen.row_group import COL, FULL, ROW
from ...codegen.row_space import RowSpace
from .dropout_members import DrawnMask
from .epilogue_members import BiasFree

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
FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # what row kernels load, compute in fp32 and round to


@dataclass(frozen=True)
class StateInput:
    """A parameter or buffer that is no graph node (a leaf module's weight), by qualified name."""

    target: str
    info: TensorInfo

    @property
    def name(self) -> str:
        return self.target.replace(".", "_")


def info_of(value) -> TensorInfo | None:
    if isinstance(value, (StateInput, DrawnMask, BiasFree)):
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


def as_state(value, gm: torch.fx.GraphModule):
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
    if op.name in ("cross_entropy", *BATCH_NORMS) and (xinfo.dtype != DTYPE or (op.name != "cross_entropy" and
                                                                              info.dtype != DTYPE)):
        return f"{op.name} in {xinfo.dtype}: row kernels take its float32 form"
    if xinfo.dtype not in FLOATS or info.dtype not in FLOATS:
        return f"{op.name} of {xinfo.dtype} into {info.dtype}: row kernels compute float tensors"
    if xinfo.dtype != info.dtype and params_dtype(bound) != info.dtype:
        return f"{op.name} of {xinfo.dtype} into {info.dtype}"
    full, params = xinfo.shape, dict(bound.params)
    if len(full) < 2 or full[-1] < 2:
        return f"rows of shape {list(full)}: a row kernel reduces a last dim of 2 or more over leading dims"
    if op.name != "cross_entropy" and not dense(info):
        return f"eager makes it with strides {info.stride}, overlapping or with gaps; a fused kernel writes dense tensors"
    if op.name == "cat":
        return _rotation_member(node, gm, bound, info)
    operands = [as_state(v, gm) for v in bound.operands]
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
                or params.get("dtype") not in (None, info.dtype):
            return f"{op.name} over dim {params.get('dim')} (keepdim={params.get('keepdim')}): row kernels " \
                   "reduce the last dim, keeping it"
    elif op.name in ("softmax", "log_softmax"):
        if not _dim_is_last(params.get("dim"), len(full)) or params.get("dtype") not in (None, info.dtype):
            return f"{op.name} over dim {params.get('dim')}: row kernels normalize the last dim"
    else:
        shape = params.get("normalized_shape")
        if not isinstance(shape, (list, tuple)) or tuple(shape) != full[-1:]:
            return f"{op.name} over {shape}: row kernels normalize the last dim alone"
        for v in operands[1:]:
            if v is not None and (info_of(v) is None or info_of(v).dtype != xinfo.dtype or
                                  kind_of(info_of(v).shape, rows) != COL):
                return f"{op.name}'s weight or bias is not a vector of the last dim in its input's dtype"
        if xinfo.dtype != info.dtype:
            return f"{op.name} of {xinfo.dtype} into {info.dtype}"
        if op.name == "rms_norm" and params.get("eps") is None:
            params["eps"] = torch.finfo(xinfo.dtype).eps  # what F.rms_norm takes for None
        if not isinstance(params.get("eps"), float):
            return f"{op.name}'s eps is not a number known when tracing"
    return rows, tuple(operands), params, ()


def channel_layer_norm(node: torch.fx.Node, gm: torch.fx.GraphModule, op) -> tuple | None:
    """A layer norm over the channels of x written through permutes (timm's LayerNorm2d:
    x.permute(0, 2, 3, 1), layer_norm over the last dim, .permute(0, 3, 1, 2)), as one row
    member in x's own shape, its columns along dim 1: (F, (x, weight, bias), params, the
    permute and the norm it absorbs); None for any other node."""
    if op is None or op.name != "permute" or len(node.all_input_nodes) != 1:
        return None
    norm = node.all_input_nodes[0]
    inner = norm.all_input_nodes[0] if norm.all_input_nodes else None
    if len(norm.users) != 1 or inner is None or len(inner.users) != 1:
        return None
    nop, iop = ops.lookup(norm, gm), ops.lookup(inner, gm)
    if nop is None or nop.name != "layer_norm" or iop is None or iop.name != "permute":
        return None
    bound, nbound, ibound = ops.bind(node, gm), ops.bind(norm, gm), ops.bind(inner, gm)
    x = ibound.operands[0] if ibound is not None else None
    xinfo, info = info_of(x), tensor_info(node)
    if bound is None or nbound is None or xinfo is None or not isinstance(info, TensorInfo) or nbound.operands[0] is not inner:
        return None
    rank = len(xinfo.shape)
    moved = (0, *range(2, rank), 1)  # channels last, and back
    if rank < 3 or tuple(ibound.params.get("dims", ())) != moved or \
            tuple(bound.params.get("dims", ())) != (0, rank - 1, *range(1, rank - 1)):
        return None
    params = dict(nbound.params)
    operands = [as_state(v, gm) for v in nbound.operands]
    channels = (xinfo.shape[1],)
    if tuple(params.get("normalized_shape") or ()) != channels or not isinstance(params.get("eps"), float) \
            or xinfo.dtype != DTYPE or info.dtype != DTYPE or info.shape != xinfo.shape or not dense(info) or \
            any(v is not None and (info_of(v) is None or info_of(v).dtype != DTYPE or info_of(v).shape != channels)
                for v in operands[1:]):
        return None
    return RowSpace(tuple(xinfo.shape), (1,)), (x, *operands[1:]), params, (inner, norm)


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
    if xinfo.shape != info.shape or xinfo.dtype != info.dtype or info.dtype not in FLOATS:
        return "cat of column slices into a value of another shape or dtype"
    return RowSpace.last(info.shape), (source,), {"pieces": tuple(pieces)}, tuple(absorbed)


def _chain_step(node: torch.fx.Node, gm: torch.fx.GraphModule):
    """(op, args with PIECE for the tensor, params) and the tensor, for an elementwise node of one
    float tensor operand of its own dtype and Python scalars (a negation: exact in any); None otherwise."""
    op, bound, info = ops.lookup(node, gm), ops.bind(node, gm), tensor_info(node)
    if op is None or op.kind != "elementwise" or op.triton is None or bound is None or \
            not isinstance(info, TensorInfo) or info.dtype not in FLOATS:
        return None
    tensors = [v for v in bound.operands if isinstance(v, torch.fx.Node)]
    if len(tensors) != 1 or not isinstance(tensor_info(tensors[0]), TensorInfo) or \
            (tensor_info(tensors[0]).shape, tensor_info(tensors[0]).dtype) != (info.shape, info.dtype):
        return None
    args = tuple(PIECE if v is tensors[0] else v for v in bound.operands)
    return (op.name, args, dict(bound.params)), tensors[0]


def params_dtype(bound):
    """The dtype a reduction or softmax is asked to compute in (its input cast to it first), or None."""
    return bound.params.get("dtype") if bound is not None else None


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
    rows = RowSpace.channels(xinfo.shape)
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
            count = as_state(module.num_batches_tracked, gm)
    return rows, (operands[0], weight, bias, mean, var), {"training": training, "momentum": momentum, "eps": eps,
                                                          "count": count}, ()
