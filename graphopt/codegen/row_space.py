"""Where a row group's tensors keep their elements: rows and columns over a shape, and each tensor's
strides over them, so a row kernel reads and writes tensors as eager lays them out.

A RowSpace is the shape F of the group's full values and the dims that make a row's columns
(`col_dims`, the last dim for a norm over it; C is their product); the other dims make the rows
(R, their product). Element (row, col) of a tensor sits at

    row offset + col offset,   row offset = sum of row-dim indices x its strides,
                               col offset = sum of col-dim indices x its strides,

the row index unravelled over the row dims and the col index over the col dims, innermost last.
A tensor broadcast along a dim (size 1 there, or missing on the left) has stride 0 there: an
attention mask of [B, 1, S, S] against scores of [B, H, S, S] is read by every head. A value's
class follows: ROW values have stride 0 on every col dim, COL values on every row dim.

addressing() merges dims that every tensor steps through as one (a contiguous [B, S, D] tensor's
B and S are one row dim of B*S), so a kernel unravels as few dims as it can; the kernel's text
depends only on how many row and col dims are left, its sizes and strides are arguments.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowSpace:
    shape: tuple
    col_dims: tuple

    @classmethod
    def last(cls, shape) -> "RowSpace":
        """Rows over the leading dims, columns along the last."""
        shape = tuple(int(s) for s in shape)
        return cls(shape, (len(shape) - 1,))

    @classmethod
    def channels(cls, shape) -> "RowSpace":
        """A row per channel (dim 1), columns over the other dims: a batch norm's rows."""
        shape = tuple(int(s) for s in shape)
        return cls(shape, tuple(d for d in range(len(shape)) if d != 1))

    @property
    def row_dims(self) -> tuple:
        return tuple(d for d in range(len(self.shape)) if d not in self.col_dims)

    @property
    def rows(self) -> int:
        return math.prod(self.shape[d] for d in self.row_dims)

    @property
    def columns(self) -> int:
        return math.prod(self.shape[d] for d in self.col_dims)

    def row_shape(self) -> tuple:
        """The shape of one value per row: F with 1 at the col dims."""
        return tuple(1 if d in self.col_dims else s for d, s in enumerate(self.shape))

    def col_shape(self) -> tuple:
        """The shape of one value per column: F with 1 at the row dims."""
        return tuple(s if d in self.col_dims else 1 for d, s in enumerate(self.shape))

    def strides(self, t: torch.Tensor) -> tuple:
        """t's stride along each dim of F, broadcast as eager broadcasts it (right-aligned): 0 where
        t has size 1 or no dim; ValueError when t does not broadcast to F."""
        return self.layout_strides(tuple(t.shape), t.stride())

    def layout_strides(self, shape: tuple, stride: tuple) -> tuple:
        """strides() of a tensor of this shape and stride."""
        lead = len(self.shape) - len(shape)
        if lead < 0:
            raise ValueError(f"a tensor of shape {shape} has more dims than the rows' {list(self.shape)}")
        out = []
        for d, size in enumerate(self.shape):
            k = d - lead
            if k < 0 or shape[k] == 1:
                out.append(0)
            elif shape[k] == size:
                out.append(int(stride[k]))
            else:
                raise ValueError(f"a tensor of shape {shape} does not broadcast to {list(self.shape)}")
        return tuple(out)


@dataclass(frozen=True)
class Addressing:
    """What a row kernel's launch passes: merged row and col sizes, and per tensor its strides."""

    row_sizes: tuple
    col_sizes: tuple
    row_strides: tuple  # per tensor, one per merged row dim
    col_strides: tuple  # per tensor, one per merged col dim

    @property
    def dims(self) -> tuple[int, int]:
        return len(self.row_sizes), len(self.col_sizes)


def addressing(space: RowSpace, tensors) -> Addressing:
    """Merged dims and strides for these tensors (each broadcasting to the space's shape)."""
    return _addressing(space, tuple((tuple(t.shape), t.stride()) for t in tensors))


@functools.lru_cache(maxsize=4096)  # a launch's layouts repeat call after call: worked out once
def _addressing(space: RowSpace, layouts: tuple) -> Addressing:
    strides = [space.layout_strides(shape, stride) for shape, stride in layouts]

    def merged(dims):
        dims = [d for d in dims if space.shape[d] != 1]  # a dim of 1 is index 0 for every element
        groups: list[list[int]] = []
        for d in dims:
            if groups and all(s[groups[-1][-1]] == s[d] * space.shape[d] for s in strides):
                groups[-1].append(d)
            else:
                groups.append([d])
        sizes = tuple(math.prod(space.shape[d] for d in g) for g in groups) or (1,)
        per = tuple(tuple(s[g[-1]] for g in groups) or (0,) for s in strides)
        return sizes, per

    row_sizes, row_strides = merged(space.row_dims)
    col_sizes, col_strides = merged(space.col_dims)
    return Addressing(row_sizes, col_sizes, row_strides, col_strides)


def empty_like_order(shape, order: tuple | None, dtype, device) -> torch.Tensor:
    """An uninitialized tensor of `shape` whose dims lie in memory in `order` (outermost first),
    as eager laid out the value it stands for; contiguous when order is None."""
    if order is None or list(order) == sorted(order):
        return torch.empty(shape, dtype=dtype, device=device)
    inverse = [order.index(d) for d in range(len(order))]
    return torch.empty([shape[d] for d in order], dtype=dtype, device=device).permute(inverse)


def dim_order(shape, stride) -> tuple | None:
    """The order (outermost first) in which a tensor of these strides lays out its dims; None for
    a contiguous one. Dims of size 1 keep their place among equals."""
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            break
        expected *= size
    else:
        return None
    return tuple(sorted(range(len(shape)), key=lambda d: (-stride[d] if shape[d] != 1 else 0, d)))
