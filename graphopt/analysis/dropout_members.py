"""A dropout in training inside a fused group (an analysis: it reads the graph, never mutates).

Eager's dropout (ATen's, on CPU) draws noise = empty_like(x).bernoulli_(1 - p), divides it by
1 - p and returns x * noise, keeping the noise (x's dtype, full size) for its backward. In a
group its mask is an input the fused call draws itself (runtime/dropout_masks.py) the same
way, from the same generator, just before its kernel runs, and keeps as bool: a quarter of
eager's float32 noise. The kernel computes x * where(mask, s, 0), s the value eager's noise
holds (1 / (1 - p) rounded to x's dtype), the very product eager computes: on CPU the fused
result equals eager's bit for bit. On CUDA eager's dropout is one fused kernel with its own
random stream, so masks there follow the same distribution but are not eager's (as
torch.compile's are not).

The masks must be drawn in eager's order: a group that holds a dropout in training spans no
other node that draws (fusion.py step 2), and the group draws its masks in graph order.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.fx

from .meta import TensorInfo, tensor_info


@dataclass(frozen=True, eq=False)
class DrawnMask:
    """A fused call's input that no graph node gives: the bool mask of one dropout, drawn by the call."""

    node: torch.fx.Node  # the dropout
    p: float
    dtype: torch.dtype  # eager's noise dtype (x's), the one its draw runs in

    @property
    def name(self) -> str:
        return f"{self.node.name}_mask"

    @property
    def info(self) -> TensorInfo:
        x = tensor_info(self.node)
        return TensorInfo(x.shape, torch.bool, x.device, x.stride, x.nbytes // x.dtype.itemsize)


def training_dropout(op, params: dict) -> bool:
    """Whether the op is the plain dropout drawing a mask (train, 0 < p < 1): the draw
    dropout_masks.py repeats is this op's; feature and alpha dropouts draw otherwise."""
    return op.name == "dropout" and params.get("train") is True and 0 < params.get("p", 0) < 1


@cache
def kept_scale(p: float, dtype: torch.dtype) -> float:
    """The value eager's noise holds where the mask keeps x: 1 / (1 - p) as its div_ rounds it in dtype."""
    return float(torch.ones((), dtype=dtype).div_(1 - p))


def emit_dropout(step, x, mask, p: float, dtype: torch.dtype):
    """The steps of x * where(mask, s, 0) in dtype, written with step(op, *args, **params) (a row
    group's Builder, or an elementwise group's step list); returns the result's ref."""
    noise = step("where", mask, kept_scale(p, dtype), 0.0)
    if dtype != torch.float32:  # eager multiplies two tensors of x's dtype
        noise = step("to_dtype", noise, dtype=dtype)
    return step("mul", x, noise)
