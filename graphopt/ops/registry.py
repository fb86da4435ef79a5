"""The registry: canonical OpInfos assembled from the tables, and the index from every spelling
(callable, aten overload, method name, nn.Module class) to its op.

Built once at import. In-place twins come from aten's own in-place packets (relu -> relu_ exists
because aten.relu_ does); `<op>_out` twins from the out= overloads of the op's aten packets.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, fields, replace

import torch

from . import creation, elementwise, movement, reducing, views
from .autocast_classes import PRECISION
from .opinfo import OpInfo
from .schema import derive, is_out_argument
from .spellings import FIXED, RENAMES, SPELLINGS
from .variants import VARIANT_OF

aten = torch.ops.aten
ROOTS = {"torch": torch, "F": torch.nn.functional, "nn": torch.nn, "linalg": torch.linalg, "special": torch.special,
         "op": operator, "hop": torch.ops.higher_order, "aten": aten}
OPINFO_FIELDS = {f.name for f in fields(OpInfo)}


@dataclass(frozen=True)
class Spelling:
    name: str  # canonical op (before variant resolution)
    reverse: bool = False  # reflected dunder: first two operands swapped
    fixed: tuple = ()  # (param, value) pairs the spelling implies
    python_op: bool = False  # python operator or dunder: may be applied to non-tensors


def _ops():
    specs = {}
    for table in (elementwise.SPECS, views.SPECS, reducing.SPECS, creation.SPECS, movement.SPECS):
        assert not specs.keys() & table.keys(), specs.keys() & table.keys()
        specs.update(table)
    ops, order, renames = {}, {}, {}
    for name, spec in specs.items():
        spec = derive(spec)
        if spec is None:  # its reference overload is missing from this torch
            continue
        order[name] = spec["order"]
        renames[name] = {**spec.get("renames", {}), **RENAMES.get(name, {})}
        fields_ = {"precision": PRECISION.get(name), **{k: v for k, v in spec.items() if k in OPINFO_FIELDS}}
        ops[name] = OpInfo(name=name, **fields_)
    for name, op in list(ops.items()):
        base = VARIANT_OF.get(name, name)
        if name in elementwise.NO_TWIN or op.output != "tensor" or not hasattr(aten, base + "_"):
            continue
        twin = name + "_"
        ops[twin] = replace(op, name=twin, inplace_of=name, mutates=True, precision=None,
                             keeps_order=False)
        ops[name] = replace(op, inplace=twin)
        order[twin], renames[twin] = order[name], renames[name]
    return ops, order, renames


def _resolve_token(token):
    """Objects a spelling token names, each with whether it came from expanding an aten packet."""
    if token.startswith("."):
        return [(token[1:], False)]
    root, *path = token.split(".")
    obj = ROOTS[root]
    try:
        for attr in path:
            obj = getattr(obj, attr)
    except (AttributeError, RuntimeError):
        return []
    if isinstance(obj, torch._ops.OpOverloadPacket):
        return [(obj, False)] + [(getattr(obj, o), True) for o in obj.overloads()]
    return [(obj, False)]


def _tokens(name, text):
    """(token, explicit) pairs; tokens from `*` may name things torch does not have."""
    for token in text.split():
        if token == "*":
            yield from ((t, False) for t in (f"torch.{name}", f".{name}", f"aten.{name}"))
            if name.endswith("_"):
                yield f"F.{name}", False
        else:
            yield token, True


def is_out_overload(overload, op) -> bool:
    """An out= overload of a non-mutating op (aten.add.out): it writes into its `out` argument."""
    return not op.mutates and any(is_out_argument(a) for a in overload._schema.arguments)


def _spellings(ops):
    """Index every target to its Spelling. An explicitly listed target wins over the same overload
    reached by expanding its packet (aten.max.other is maximum though aten.max is max)."""
    targets, from_packet, unresolved = {}, set(), []
    for name, op in ops.items():
        if name not in SPELLINGS and not op.inplace_of:
            continue
        for token, explicit in _tokens(name, SPELLINGS.get(name, "*")):
            reverse, token = token.endswith("~"), token.rstrip("~")
            resolved = _resolve_token(token)
            if explicit and not resolved:
                unresolved.append(token)
            for target, packet in resolved:
                python_op = token.startswith(("op.", ".__"))
                spelling = Spelling(name, reverse, tuple(FIXED.get(token, {}).items()), python_op)
                if packet and is_out_overload(target, op):
                    spelling = replace(spelling, name=name + "_out")
                claimed = targets.get(target)
                if claimed is None or (target in from_packet and not packet):
                    targets[target] = spelling
                    if packet:
                        from_packet.add(target)
                    else:
                        from_packet.discard(target)
                elif not packet and target not in from_packet:
                    assert claimed == spelling, f"{target} spelled by {claimed.name} and {name}"
    return targets, unresolved


def _out_variants(ops, order, renames, targets):
    """Add `<op>_out` for every op (and each variant of it) whose aten packet has out= overloads."""
    outable = {s.name[:-len("_out")] for s in targets.values() if s.name.endswith("_out") and s.name not in ops}
    for name, op in list(ops.items()):
        if (name in outable or VARIANT_OF.get(name) in outable) and not op.mutates:
            out = name + "_out"
            ops[out] = replace(op, name=out, out_variant_of=name, mutates=True, precision=None, inplace=None,
                               keeps_order=False)
            ops[name] = replace(op, out_variant=out)
            order[out], renames[out] = order[name], renames[name]


OPS, ORDER, RENAME = _ops()
TARGETS, UNRESOLVED = _spellings(OPS)
_out_variants(OPS, ORDER, RENAME, TARGETS)
MODULES = {t: s for t, s in TARGETS.items() if isinstance(t, type) and issubclass(t, torch.nn.Module)}


def canonical_ops() -> dict[str, OpInfo]:
    return dict(OPS)


def spelling(target) -> Spelling | None:
    """How `target` (callable, OpOverload, method name, nn.Module class or instance) spells an op."""
    if isinstance(target, torch.nn.Module):
        target = type(target)
    if isinstance(target, type) and issubclass(target, torch.nn.Module):
        # a subclass counts only if it keeps the registered class's forward
        return next((MODULES[c] for c in target.__mro__ if c in MODULES and target.forward is c.forward), None)
    try:
        return TARGETS.get(target)
    except TypeError:  # unhashable target
        return None


def lookup_target(target) -> OpInfo | None:
    found = spelling(target)
    return OPS.get(found.name) if found else None


def targets_of(name: str) -> list:
    """Every registered spelling of op `name` (for passes that rewrite a node into another op)."""
    return [t for t, s in TARGETS.items() if s.name == name]
