"""A linear's or convolution's bias add as the first step of the fused group after it (an
analysis: it reads the graph, never mutates).

An activation between two linears (BERT's and ViT's GELU, a convnet's SiLU between convolutions)
has no elementwise neighbour: alone, a kernel of its own would move the bytes eager's op moves.
But its producer adds a bias, which eager does inside the matmul. Taking that add out (as
Inductor does for an addmm whose output feeds pointwise ops) makes the activation a group of
two: the matmul runs without its bias, the group adds it and applies what follows, and its
backward computes the bias's gradient as a reduction of the gradient it already forms (the
column sums a norm's weight gets, or a batch norm's per-channel sums), where eager's matmul
backward reads the whole output gradient once more for it.

The group is a row group: a linear's rows are its last dim, the bias per column; a
convolution's are its channels (as a batch norm's), the bias per row. The matmul without its
bias is a group input no graph node gives yet (BiasFree); the fuse pass inserts it where the
matmul was. Eager adds the bias inside the matmul's sum, the group after it: the result
differs from eager's by float32 rounding, within the tolerance of another order of a float32
sum, not bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F

from ...analysis.meta import TensorInfo, dense, tensor_info
from ...codegen.row_group import COL, ROW
from ...codegen.row_space import RowSpace

# the ops whose bias a group may take over, and the torch function that computes them without it
WITHOUT_BIAS = {"linear": F.linear, "conv1d": F.conv1d, "conv2d": F.conv2d, "conv3d": F.conv3d}
CONV_PARAMS = ("stride", "padding", "dilation", "groups")


@dataclass(frozen=True, eq=False)
class BiasFree:
    """A fused call's input that no graph node gives yet: the linear or convolution without its
    bias; the fuse pass inserts it where the node was."""

    node: torch.fx.Node
    op: str  # linear, conv1d, conv2d or conv3d: WITHOUT_BIAS[op] computes it, given CONV_PARAMS for a convolution

    @property
    def name(self) -> str:
        return f"{self.node.name}_without_bias"

    @property
    def info(self) -> TensorInfo:
        return tensor_info(self.node)


def epilogue_member(node: torch.fx.Node, op, bound) -> tuple | None:
    """(rows, the bias as bound: a Parameter or a node, its class in the rows) when a group after
    the node may take over its bias add; None when it may not (the node stays a matmul)."""
    if op is None or op.name not in WITHOUT_BIAS or bound is None or len(bound.operands) < 3:
        return None
    bias, info = bound.operands[2], tensor_info(node)
    binfo = TensorInfo.of(bias) if isinstance(bias, torch.Tensor) else \
        tensor_info(bias) if isinstance(bias, torch.fx.Node) else None
    if not isinstance(info, TensorInfo) or not isinstance(binfo, TensorInfo) or info.dtype != torch.float32 \
            or binfo.dtype != torch.float32 or not info.contiguous or not dense(info):
        return None
    if op.name == "linear":
        if len(info.shape) < 2 or info.shape[-1] < 2 or binfo.shape != info.shape[-1:]:
            return None
        return RowSpace.last(info.shape), bias, COL
    if binfo.shape != (info.shape[1],) or len(info.shape) < 3 or \
            any(not isinstance(bound.params.get(p), (int, tuple, list)) for p in CONV_PARAMS):
        return None
    return RowSpace.channels(info.shape), bias, ROW


def gates_channels(rows: RowSpace, kind: str) -> bool:
    """Whether the bias add is a convolution's on a 1x1 map (squeeze-excite): each of its values
    scales a whole channel of the block after it."""
    return kind == ROW and len(rows.shape) > 2 and all(s == 1 for s in rows.shape[2:])
