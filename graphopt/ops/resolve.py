"""Node-level questions: which op an fx node calls (lookup) and with what (bind).

Unknown targets, unmatchable arguments and python arithmetic on non-tensors all come back as None;
nothing here raises on a graph it does not understand.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from . import variants
from .binding import arguments, same
from .opinfo import Bound, OpInfo
from .registry import OPS, spelling
from .spellings import NEUTRAL

MAX_DEPTH = 32  # how far `produces` follows chains of meta-less python arithmetic before guessing
TENSOR_ATTRIBUTES = {"T", "mT", "H", "mH", "data", "grad", "real", "imag"}


def produces(node: Node, depth: int = 0) -> str:
    """What a node evaluates to: "tensor", "tuple", "scalar" or "unknown"."""
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    if val is not None:
        if isinstance(val, torch.Tensor) or (hasattr(val, "dtype") and hasattr(val, "shape")):  # or TensorMetadata
            return "tensor"
        return "tuple" if isinstance(val, (list, tuple)) and not isinstance(val, torch.Size) else "scalar"
    if node.op in ("placeholder", "get_attr"):
        return "tensor"
    if node.op == "call_function" and node.target is getattr:  # x.shape, x.dtype, ... but x.T is a tensor
        attr = node.args[1] if len(node.args) > 1 else None
        return "tensor" if isinstance(attr, str) and attr in TENSOR_ATTRIBUTES else "scalar"
    if depth >= MAX_DEPTH:
        return "unknown"
    found = _resolve(node, None, depth + 1)
    if found is None:
        return "unknown"
    return {"none": "scalar"}.get(found[0].output, found[0].output)


def _on_tensors(node: Node, depth: int) -> bool:
    """Python operators and dunders are tensor ops only when applied to tensors."""
    val = node.meta.get("val")
    if val is not None:
        return isinstance(val, torch.Tensor)
    inputs = node.all_input_nodes
    return any(produces(n, depth + 1) in ("tensor", "unknown") for n in inputs)


def _variant(name: str, args: dict, node: Node, depth: int) -> str | None:
    want_out = args.pop("out", None) is not None
    want_inplace = bool(args.pop("inplace", False))
    op = OPS[name]
    base = op.inplace_of or op.out_variant_of or name
    resolved = variants.resolve(base, args, node, lambda n: produces(n, depth + 1))
    if resolved not in OPS:  # no op matches, or the variant's reference overload is missing from this torch
        return None
    if op.inplace_of:
        resolved = OPS[resolved].inplace or name
    if op.out_variant_of:
        resolved = OPS[resolved].out_variant or name
    if want_inplace and not op.inplace_of:
        resolved = OPS[resolved].inplace
    if want_out and resolved and not op.out_variant_of:
        resolved = OPS[resolved].out_variant
    return resolved


def _resolve(node: Node, gm: GraphModule | None, depth: int):
    """(op, canonical args, explicitly passed names); args are None when they could not be matched."""
    module = None
    if node.op == "call_module":
        root = gm if gm is not None else node.graph.owning_module
        try:
            module = root.get_submodule(node.target)
        except AttributeError:
            return None
        found = spelling(module)
    elif node.op in ("call_function", "call_method"):
        found = spelling(node.target)
    else:
        return None
    if found is None or (found.python_op and found.name != "getitem" and not _on_tensors(node, depth)):
        return None
    bound = arguments(node, found, module, lambda n: produces(n, depth + 1))
    if bound is None:
        op = OPS[found.name]
        base = op.inplace_of or op.out_variant_of or found.name
        ambiguous = base in variants.RULES or {"out", "inplace"} & set(node.kwargs)
        return None if ambiguous else (op, None, None)
    args, explicit = bound
    name = _variant(found.name, args, node, depth)
    return (OPS[name], args, explicit) if name else None


# _resolve's answer is kept on its node, with what it was read from (_read): passes ask the same node many
# times over, and binding its arguments is the dear part. On the node, it lives as long as the graph; a
# table by node would keep every graph alive through its answers' arguments (other nodes of the graph).
_ANSWER = "_graphopt_resolved"


def _read(node: Node) -> tuple | None:
    """Everything _resolve reads of a call_function or call_method node whose inputs all carry
    metadata: its target and arguments (fx replaces the tuples when they change) and each one's
    metadata object (a new one when it is annotated again). None where some input has none: its
    kind would be resolved in turn, through nodes this does not cover; and for a call_module
    node, whose module's attributes are read too."""
    if node.op not in ("call_function", "call_method"):
        return None
    read = [node.target, node.args, node.kwargs]
    for n in (node, *node.all_input_nodes):
        val = n.meta.get("val", n.meta.get("tensor_meta"))
        if val is None and n is not node:
            return None
        read.append(val)
    return tuple(read)


def _resolved(node: Node, gm: GraphModule | None):
    """_resolve(node, gm, 0), answered again while nothing it read has changed (compared by
    identity: equal arguments can be other nodes)."""
    read = _read(node)
    if read is None:
        return _resolve(node, gm, 0)
    held = getattr(node, _ANSWER, None)
    if held is not None and len(held[0]) == len(read) and all(a is b for a, b in zip(held[0], read)):
        return held[1]
    found = _resolve(node, gm, 0)
    setattr(node, _ANSWER, (read, found))
    return found


def lookup(node: Node, gm: GraphModule | None = None) -> OpInfo | None:
    found = _resolved(node, gm)
    return found[0] if found else None


def _neutral(name, value) -> bool:
    allowed = NEUTRAL.get(name, ())
    return allowed is None or any(same(value, v) for v in allowed)


def bind(node: Node, gm: GraphModule | None = None) -> Bound | None:
    found = _resolved(node, gm)
    if found is None or found[1] is None:
        return None
    op, args, explicit = found
    if op.out_variant_of:
        return None  # the out= tensor has no place in operands or params
    params = {name: args.get(name, default) for name, default in op.params}
    for name in set(args) - set(op.operands) - set(params):  # spelling-only arguments
        if name in explicit and not _neutral(name, args[name]):
            return None  # e.g. embedding's max_norm, a conv's padding_mode="reflect"
    operands = tuple(args.get(name) for name in op.operands)
    if op.kind == "elementwise" and (
            any(not isinstance(v, (Node, int, float, bool)) for v in operands)
            or any(v is None for v in params.values())):
        return None  # a template needs every operand and a literal for every param
    return Bound(op, operands, params)
