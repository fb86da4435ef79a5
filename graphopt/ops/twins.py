"""How to call an op's in-place twin with a node's bound arguments (for rewriting passes)."""
from __future__ import annotations

import torch

from .opinfo import Bound
from .variants import BY_VALUE, VARIANT_OF

aten = torch.ops.aten


def inplace_call(bound: Bound):
    """(target, args, kwargs) calling bound.op's in-place twin on its first operand, as aten's
    in-place packet of the op (or of its base, with the argument that selects the variant);
    None when the op has no twin aten can call."""
    name = bound.op.name
    if not bound.op.inplace:
        return None
    base = name if hasattr(aten, name + "_") else VARIANT_OF.get(name)
    if base is None or not hasattr(aten, base + "_"):
        return None
    selector = {}
    if base in BY_VALUE:
        arg, _, choices = BY_VALUE[base]
        selector = {arg: value for value, op in choices.items() if op == name}
    return getattr(aten, base + "_"), tuple(bound.operands), {**bound.params, **selector}
