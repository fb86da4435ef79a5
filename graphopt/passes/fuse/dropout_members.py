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

Stochastic depth (timm's drop_path, torchvision's stochastic_depth once normalize spelled it
out) draws its per-sample noise as torch.bernoulli(x.new_empty((N, 1, ..., 1)), p): ATen's
functional bernoulli is empty_like(its input).bernoulli_(p), reading nothing of its input but
its shape. In a group that bernoulli is a member whose mask the call draws the same way, at the
runtime shape of that same input (the graph still gives it to the call, for its shape only);
the member's value is where(mask, 1, 0) in eager's dtype, the noise's own values, and the
divide and multiply after it are ordinary members.

The masks must be drawn in eager's order: a group that holds a draw spans no other node that
draws (fusion.py step 2), and the group draws its masks in graph order.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.fx

from ...analysis.meta import TensorInfo, tensor_info
from ...codegen.group import FLOATS


@dataclass(frozen=True, eq=False)
class DrawnMask:
    """A fused call's input that no graph node gives: the bool mask of one dropout or bernoulli,
    drawn by the call."""

    node: torch.fx.Node  # the dropout or the bernoulli
    keep: float  # the probability of a one (eager's bernoulli_ argument)
    dtype: torch.dtype  # eager's noise dtype (x's), the one its draw runs in
    shape_of: torch.fx.Node | None = None  # a bernoulli's input: the call draws at its shape; None: at the group's

    def draw(self, place: int) -> tuple:
        """What the fused call needs to draw it (runtime/dropout_masks.py): (place, keep, dtype, sourced)."""
        return place, self.keep, self.dtype, self.shape_of is not None

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


def drawn_bernoulli(node: torch.fx.Node, op, bound) -> "DrawnMask | str | None":
    """A bernoulli whose draw a fused call can repeat: its mask; a reason when it is a bernoulli
    that cannot join a group; None for any other op."""
    if op is None or op.name != "bernoulli" or bound is None:
        return None
    keep, source = bound.params.get("p"), bound.operands[0] if bound.operands else None
    info = tensor_info(node)
    if not isinstance(keep, float) or not 0 <= keep <= 1 or not isinstance(source, torch.fx.Node):
        return "random (a bernoulli of a tensor of probabilities draws from the RNG element by element)"
    if node.kwargs.get("generator") is not None:
        return "random (a bernoulli from its own generator)"
    if not isinstance(info, TensorInfo) or info.dtype not in FLOATS or not info.contiguous:
        return f"random (a bernoulli of {info.short() if isinstance(info, TensorInfo) else 'no tensor'}: a fused " \
               "call draws contiguous float noise)"
    return DrawnMask(node, keep, info.dtype, source)


@cache
def kept_scale(keep: float, dtype: torch.dtype) -> float:
    """The value eager's noise holds where the mask keeps x: 1 / (1 - p) as its div_ rounds it in dtype."""
    return float(torch.ones((), dtype=dtype).div_(keep))


def emit_dropout(step, x, mask, keep: float, dtype: torch.dtype):
    """The steps of x * where(mask, s, 0) in dtype, written with step(op, *args, **params) (a row
    group's Builder, or an elementwise group's step list); returns the result's ref."""
    return step("mul", x, _noise(step, mask, kept_scale(keep, dtype), dtype))


def emit_bernoulli(step, mask, dtype: torch.dtype):
    """The steps of eager's bernoulli noise, where(mask, 1, 0) in dtype; returns its ref."""
    return _noise(step, mask, 1.0, dtype)


def _noise(step, mask, kept: float, dtype: torch.dtype):
    noise = step("where", mask, kept, 0.0)
    if dtype != torch.float32:  # eager's noise is a tensor of x's dtype
        noise = step("to_dtype", noise, dtype=dtype)
    return noise
