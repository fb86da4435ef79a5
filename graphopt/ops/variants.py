"""Variant resolution: the canonical op a call really is, given its arguments.

One spelling can mean several ops (F.gelu(x, approximate="tanh") is gelu_tanh, torch.max(x, 1) is
max_dim, x ** 2 is pow_scalar). A rule sees the call's canonical arguments, may consume the argument
that selected the variant, and returns the op name, or None when no registered op matches (the call
is then opaque).
"""
from __future__ import annotations

from collections.abc import Hashable

import torch
from torch.fx import Node

# base: (argument, its default, {value: op}); a value missing from the map selects no op
BY_VALUE = {
    "gelu": ("approximate", "none", {"none": "gelu", "tanh": "gelu_tanh"}),
    "div": ("rounding_mode", None, {None: "div", "trunc": "div_trunc", "floor": "div_floor"}),
    "round": ("decimals", 0, {0: "round"}),
}


def _by_value(arg, default, choices):
    def rule(a, node, produces):
        value = a.pop(arg, default)
        return choices.get(value) if isinstance(value, Hashable) else None
    return rule


def _tensor(v, produces) -> bool:
    return isinstance(v, torch.Tensor) or (isinstance(v, Node) and produces(v) in ("tensor", "unknown"))


def _pow(a, node, produces):
    if "y" not in a:
        return None
    if _tensor(a["y"], produces) or not _tensor(a.get("x"), produces):
        return "pow"
    a["exponent"] = a.pop("y")
    return "pow_scalar"


def _clamp(a, node, produces):
    lo, hi = a.get("min") is not None, a.get("max") is not None
    if lo and hi:
        return "clamp"
    a.pop("max" if lo else "min", None)
    return "clamp_min" if lo else "clamp_max" if hi else None


def _extremum(name, binary):
    def rule(a, node, produces):
        if a.get("y") is not None:
            return binary
        return name + "_dim" if a.get("dim") is not None else name
    return rule


def _bool_as_logical(name):
    # on bool tensors &, |, ^, ~ are the logical ops, which have fp32 Triton forms
    def rule(a, node, produces):
        val = node.meta.get("val")
        return "logical_" + name[len("bitwise_"):] if getattr(val, "dtype", None) == torch.bool else name
    return rule


def _train(name):
    def rule(a, node, produces):
        return name + "_train" if a.get("training") and a.get("running_mean") is not None else name
    return rule


def _same_device(device, x) -> bool:
    val = x.meta.get("val") if isinstance(x, Node) else None
    try:
        return isinstance(val, torch.Tensor) and torch.device(device) == val.device
    except (RuntimeError, TypeError):  # not a device: a Node, a malformed string
        return False


def _to(a, node, produces):
    other = a.pop("y", None)  # x.to(other) / x.type_as(other): other's dtype (and device for .to)
    if isinstance(other, Node) and isinstance(other.meta.get("val"), torch.Tensor):
        a.setdefault("dtype", other.meta["val"].dtype)
    device = a.pop("device", None)
    if device is None or _same_device(device, a.get("x")):
        return "to_dtype" if a.get("dtype") is not None or device is None else "to_device"
    a["device"] = device
    return "to_device"


def _getitem(a, node, produces):
    x, index = a.get("x"), a.get("index")
    kind = produces(x) if isinstance(x, Node) else None
    if kind == "tuple":
        return "tuple_getitem"
    if kind != "tensor":
        return None  # indexing a shape, or a value of unknown type
    items = index if isinstance(index, tuple) else (index,)
    advanced = any(isinstance(i, (list, torch.Tensor)) or (isinstance(i, Node) and produces(i) != "scalar")
                   for i in items)
    return "getitem_index" if advanced else "getitem"


def _max_pool(name):
    def rule(a, node, produces):
        return name + "_with_indices" if a.pop("return_indices", False) else name
    return rule


RULES = {
    "pow": _pow,
    "clamp": _clamp,
    "max": _extremum("max", "maximum"),
    "min": _extremum("min", "minimum"),
    "bitwise_and": _bool_as_logical("bitwise_and"),
    "bitwise_or": _bool_as_logical("bitwise_or"),
    "bitwise_xor": _bool_as_logical("bitwise_xor"),
    "bitwise_not": _bool_as_logical("bitwise_not"),
    "batch_norm": _train("batch_norm"),
    "native_batch_norm": _train("native_batch_norm"),
    "to_dtype": _to,
    "getitem": _getitem,
    "view": lambda a, node, produces: None if isinstance(a.get("size"), torch.dtype) else "view",
    "where": lambda a, node, produces: "where" if "x" in a and "y" in a else None,  # torch.where(cond) is nonzero
    "scaled_dot_product_attention": lambda a, node, produces: (
        "scaled_dot_product_attention_dropout" if a.get("dropout_p") else "scaled_dot_product_attention"),
    **{f"max_pool{d}d": _max_pool(f"max_pool{d}d") for d in (2, 3)},
    **{base: _by_value(*spec) for base, spec in BY_VALUE.items()},
}

# every op a rule can return, with the base whose spellings reach it
VARIANT_OF = {
    "gelu_tanh": "gelu", "div_trunc": "div", "div_floor": "div", "pow_scalar": "pow",
    "clamp_min": "clamp", "clamp_max": "clamp", "maximum": "max", "minimum": "min", "max_dim": "max",
    "min_dim": "min", "batch_norm_train": "batch_norm", "native_batch_norm_train": "native_batch_norm",
    "to_device": "to_dtype", "tuple_getitem": "getitem", "getitem_index": "getitem",
    "scaled_dot_product_attention_dropout": "scaled_dot_product_attention",
    "max_pool2d_with_indices": "max_pool2d", "max_pool3d_with_indices": "max_pool3d",
    **{f"logical_{n}": f"bitwise_{n}" for n in ("and", "or", "xor", "not")},
}


def resolve(name: str, args: dict, node: Node, produces) -> str | None:
    rule = RULES.get(name)
    return rule(args, node, produces) if rule else name
