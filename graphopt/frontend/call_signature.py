"""A call's signature: its structure and, per tensor, shape, dtype and device; what graphs are
built for, guarded by and kept under."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from ..analysis.planning_device import seen_as


def signature(args: tuple, kwargs: dict, shapes: bool = True) -> tuple:
    """A hashable description of a call: structure, and per tensor its shape (or, without
    shapes, its number of dimensions), dtype, device."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            shape = tuple(leaf.shape) if shapes else leaf.dim()
            device = seen_as(leaf.device)
            parts.append(("tensor", shape, leaf.dtype, device.type, device.index))
        else:
            try:
                hash(leaf)
                parts.append(("value", type(leaf).__name__, leaf))
            except TypeError:
                parts.append(("value", type(leaf).__name__, repr(leaf)))
    return (str(spec), tuple(parts))
