"""Matching a call node's args/kwargs to its op's canonical argument names.

The spelling's own signature does the matching where one exists (the aten schema of an overload,
the python signature of an F function, torch's signatures for builtins and Tensor methods); python
operators, dunders and signature-less builtins bind positionally in the op's canonical order; an
nn.Module contributes its attributes. Spelling names are then renamed to canonical ones.

The signatures are the ones torch.fx.operator_schemas.normalize_function uses, but the matching is
done here: bind must know which arguments the call passed (a spelling-only argument left at its
default is harmless), and normalize_function raises on overloads it cannot tell apart, where a
tensor-vs-number check on the arguments settles it. normalize_module only knows torch.nn's own
classes; module.forward's signature serves subclasses too.
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch._jit_internal import boolean_dispatched
from torch.fx import Node
from torch.fx.operator_schemas import get_signature_for_torch_op

from .registry import ORDER, RENAME, Spelling
from .schema import canonical
from .spellings import MODULE_ATTR_FNS, MODULE_ATTRS, VARARG_METHODS

aten = torch.ops.aten
SCALAR_TYPES = ("int", "float", "Number", "bool", "complex")


@functools.lru_cache(maxsize=None)
def signatures(target) -> tuple[inspect.Signature, ...]:
    """Candidate signatures of a call_function target or a Tensor method name."""
    if isinstance(target, str):  # a method binds like the torch function or aten packet of that name
        fn = getattr(torch, target, None)
        target = fn if callable(fn) and not isinstance(fn, type) else getattr(aten, target, None)
        if target is None:
            return ()
    try:
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or inspect.isbuiltin(target):
            sigs = get_signature_for_torch_op(target)
            return tuple(sigs) if isinstance(sigs, list) else (sigs,) if sigs else ()
        # F.max_pool2d and friends dispatch on a flag between two functions of one signature
        target = boolean_dispatched.get(target, {}).get("if_true", target)
        return (inspect.signature(inspect.unwrap(target)),)
    except (TypeError, ValueError, RuntimeError):
        return ()


def _plausible(sig, arguments, produces) -> bool:
    """Whether tensors land on tensor parameters and numbers on number parameters."""
    for name, value in arguments.items():
        ann = str(sig.parameters[name].annotation)
        scalar_param = any(t in ann for t in SCALAR_TYPES)
        if isinstance(value, Node) and produces(value) == "tensor" and scalar_param and "Tensor" not in ann:
            return False
        if isinstance(value, (int, float, bool)) and "Tensor" in ann and not scalar_param:
            return False
    return True


def same(a, b) -> bool:
    """Equal values, without tensor or Node comparison semantics."""
    return a is b or (not isinstance(a, (Node, torch.Tensor)) and type(a) is type(b) and a == b)


def _with_defaults(bound):
    """All arguments, and the names set to something other than the signature's default."""
    params = bound.signature.parameters
    explicit = {k for k, v in bound.arguments.items() if not same(v, params[k].default)}
    bound.apply_defaults()
    return dict(bound.arguments), explicit


def _bind(sigs, args, kwargs, produces):
    fallback = None
    for sig in sigs:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            continue
        if _plausible(sig, bound.arguments, produces):
            return _with_defaults(bound)
        fallback = fallback or bound
    return _with_defaults(fallback) if fallback else None


def _bind_positional(order, args, kwargs):
    if len(args) > len(order):
        return None
    values = {**dict(zip(order, args)), **kwargs}
    return values, set(values)


def _bind_to(args, kwargs, produces):
    """Tensor.to(dtype | device | other, ...) and the aten.to packet: positional meaning is by type."""
    values = {"x": args[0]} if args else {}
    for a in args[1:]:
        if isinstance(a, torch.dtype):
            values["dtype"] = a
        elif isinstance(a, (str, torch.device)):
            values["device"] = a
        elif isinstance(a, Node):
            values["y" if produces(a) == "tensor" else "device"] = a
        elif isinstance(a, bool):
            values["copy" if "non_blocking" in values else "non_blocking"] = a
    values.update(kwargs)
    return values, set(values)


def _module_attrs(module) -> dict:
    for cls in type(module).__mro__:
        if cls.__name__ in MODULE_ATTR_FNS:
            return MODULE_ATTR_FNS[cls.__name__](module)
        if cls.__name__ in MODULE_ATTRS:
            pairs = (item.partition("=")[::2] for item in MODULE_ATTRS[cls.__name__].split())
            return {param: getattr(module, attr or param, None) for param, attr in pairs}
    return {}


def _bind_module(module, args, kwargs):
    try:
        values, explicit = _with_defaults(inspect.signature(module.forward).bind(*args, **kwargs))
    except (TypeError, ValueError):
        return None
    attrs = _module_attrs(module)
    return {**values, **attrs}, explicit | set(attrs)


def arguments(node: Node, spelling: Spelling, module, produces):
    """({canonical name: value}, names the call passed explicitly), or None if it cannot be matched."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if module is not None:
        bound = _bind_module(module, args, kwargs)
    elif node.target == "to" or node.target is aten.to:
        bound = _bind_to(args, kwargs, produces)
    else:
        if node.op == "call_method" and node.target in VARARG_METHODS and len(args) > 2:
            args = [args[0], tuple(args[1:])]
        sigs = () if spelling.python_op else signatures(node.target)
        bound = _bind(sigs, args, kwargs, produces) or _bind_positional(ORDER[spelling.name], args, kwargs)
    if bound is None:
        return None
    values, explicit = bound
    renames = RENAME[spelling.name]
    values = {canonical(k, renames): v for k, v in values.items()}
    explicit = {canonical(k, renames) for k in explicit}
    if spelling.reverse:
        if "x" not in values or "y" not in values:
            return None
        values["x"], values["y"] = values["y"], values["x"]
    values.update(spelling.fixed)
    return values, explicit | {k for k, _ in spelling.fixed}
