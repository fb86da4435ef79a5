"""Where each tensor's elements live, relative to the kernel's flat index over the group's full shape.

1. The full shape is the broadcast of the inputs' shapes; a kernel runs one flat index over it.
2. Every tensor the kernel touches gets strides over the full shape: its own on the dims it spans,
   0 on the dims it is broadcast along (missing, size 1, or expanded with stride 0).
3. Size-1 dims are dropped, and neighbouring dims merge where every tensor steps through them as
   through one (stride[d] == stride[d+1] * size[d+1]): fewer dims, fewer divisions in the kernel.
4. A tensor's pattern is "flat" when its strides are the contiguous ones (its offset is the flat
   index itself), else per dim 0 (broadcast), 1 (unit stride) or "s" (a stride passed at launch).
   Patterns and the merged rank go into a kernel's key; sizes and strides are launch arguments, so a
   new batch size reuses the kernel.
5. Offsets are 64-bit when the flat index (plus a block) or a tensor's largest offset can pass 2**31.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MAX_BLOCK = 2**16  # no launch uses a larger block, so the int64 decision need not know the block
INT32_LIMIT = 2**31 - 1


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def expanded_strides(shape, strides, full) -> tuple[int, ...]:
    """A tensor's strides over the full shape it broadcasts to (step 2)."""
    lead = len(full) - len(shape)
    return tuple(0 if d < lead or shape[d - lead] == 1 else strides[d - lead] for d in range(len(full)))


@dataclass(frozen=True)
class Layout:
    numel: int
    sizes: tuple[int, ...]  # merged full shape, no size-1 dims
    strides: tuple[tuple[int, ...], ...]  # one entry per tensor, over `sizes`

    @property
    def rank(self) -> int:
        return len(self.sizes)

    def pattern(self, k: int):
        s = self.strides[k]
        if s == contiguous_strides(self.sizes):
            return "flat"
        return tuple(0 if v == 0 else 1 if v == 1 else "s" for v in s)

    def index64(self) -> bool:
        largest = max((sum((n - 1) * v for n, v in zip(self.sizes, s)) for s in self.strides), default=0)
        return self.numel + MAX_BLOCK > INT32_LIMIT or largest > INT32_LIMIT


def collapse(full, strides) -> Layout:
    """Steps 3-4 for tensors with `strides` over the full shape."""
    dims = [d for d, n in enumerate(full) if n != 1]
    sizes = [full[d] for d in dims]
    per = [[s[d] for d in dims] for s in strides]
    d = len(sizes) - 2
    while d >= 0:
        if all(s[d] == s[d + 1] * sizes[d + 1] for s in per):
            sizes[d] *= sizes.pop(d + 1)
            for s in per:
                s[d] = s.pop(d + 1)
        d -= 1
    return Layout(math.prod(full), tuple(sizes), tuple(tuple(s) for s in per))


def unravel_dims(patterns, rank: int, extra=()) -> list[int]:
    """The dims whose index the kernel needs: those a non-flat tensor steps along, plus `extra`."""
    used = set(extra)
    for p in patterns:
        if p != "flat":
            used.update(d for d, v in enumerate(p) if v != 0)
    return sorted(d for d in used if d < rank)


def size_params(dims: list[int], rank: int) -> list[int]:
    """The dims whose size the unravel divides by: every dim inside the outermost used one, and that
    one too unless it is dim 0 (the quotient is already its index)."""
    if not dims:
        return []
    return list(range(max(dims[0], 1), rank))
