"""Deriving operands and params from a reference aten overload, so a table row names one overload
instead of restating its signature.

Tensor-typed arguments become operands, the rest params (schema default, or None where the schema
has none), in canonical names: `self`/`input` -> x, `other` -> y, plus a row's own renames. The
schema order is kept for binding positional arguments of spellings that have no signature.
"""
from __future__ import annotations

import torch

GENERIC_RENAMES = {"self": "x", "input": "x", "other": "y", "tensor": "x", "a": "x", "b": "y"}


def ref(overload: str, **opts) -> dict:
    """A table row whose operands/params come from `overload` ("aten.view.default")."""
    return dict(ref=overload, **opts)


def explicit(operands: str, params: dict | None = None, **opts) -> dict:
    """A table row for an op with no aten overload to copy (python-level ops, bookkeeping)."""
    return dict(operands=tuple(operands.split()), params=tuple((params or {}).items()), **opts)


def overload(path: str):
    """'aten.view.default' -> torch.ops.aten.view.default, None if this torch lacks it."""
    _, packet, name = path.split(".")
    return getattr(getattr(torch.ops.aten, packet, None), name, None)


def canonical(name: str, renames: dict) -> str:
    return renames.get(name) or GENERIC_RENAMES.get(name, name)


def is_out_argument(arg) -> bool:
    return arg.kwarg_only and arg.alias_info is not None and arg.alias_info.is_write


def derive(spec: dict) -> dict:
    """Fill operands, params, order and output of a `ref` row from its overload's schema."""
    if "ref" not in spec:
        return dict(spec, order=spec["operands"] + tuple(p for p, _ in spec["params"]))
    op = overload(spec["ref"])
    if op is None:  # an overload this torch version lacks: the row is skipped
        return None
    renames = spec.get("renames", {})
    operands, params, order = [], [], []
    for arg in op._schema.arguments:
        if is_out_argument(arg):
            continue
        name = canonical(arg.name, renames)
        order.append(name)
        if "Tensor" in str(arg.type):
            operands.append(name)
        else:
            default = arg.default_value if arg.has_default_value() else None
            params.append((name, tuple(default) if isinstance(default, list) else default))  # OpInfo stays hashable
    params = dict(params, **spec.get("defaults", {}))
    returns = op._schema.returns
    output = ("none" if not returns else "tuple" if len(returns) > 1 or isinstance(returns[0].type, torch.ListType)
              else "tensor" if "Tensor" in str(returns[0].type) else "scalar")
    rest = {k: v for k, v in spec.items() if k not in ("ref", "defaults")}
    return {"output": output, **rest, "operands": tuple(operands), "params": tuple(params.items()),
            "order": tuple(order)}
