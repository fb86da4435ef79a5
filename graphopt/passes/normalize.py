"""normalize: give each op one spelling, the torch function, so later passes see one form.

Algorithm:
  1. For each call_method, operator.* or stateless call_module node, ask the registry
     which canonical op it is (lookup). Unknown ops are left alone.
  2. Find the canonical callable: torch.<name>, else torch.nn.functional.<name>, and keep
     it only if the registry maps it back to the same op.
  3. Build its arguments: the node's own arguments for methods and operators (the tensor
     comes first in both spellings); the registry's bound operands and params for modules.
     Skip the rewrite when the first operand is not a tensor (2 + x has no torch.add form).
  4. Check the rewrite on the node's FakeTensor inputs: the callable must accept the
     arguments and produce the same shape, dtype and stride; otherwise skip it and say why.
  5. Rewrite the node in place: its name, metadata and source location stay.

Modules with parameters or buffers, and random or mutating ops, keep their spelling:
their state and train/eval behaviour live in the module.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

from .. import ops
from .base import Pass, PassContext, PassResult
from .registry import register


def _canonical_callable(op):
    for namespace in (torch, F):
        fn = getattr(namespace, op.name, None)
        if callable(fn) and ops.lookup_target(fn) is op:
            return fn
    return None


def _fake(value):
    if isinstance(value, torch.fx.Node):
        return value.meta.get("val")
    if isinstance(value, (list, tuple)):
        return type(value)(_fake(v) for v in value)
    return value


def _same_result(fn, args, kwargs, node) -> bool:
    expected = node.meta.get("val")
    first = expected[0] if isinstance(expected, (tuple, list)) and expected else expected
    if not isinstance(first, torch.Tensor) or not hasattr(first, "fake_mode"):
        return False
    try:
        with first.fake_mode:
            got = fn(*_fake(tuple(args)), **{k: _fake(v) for k, v in kwargs.items()})
    except Exception:  # the callable does not take these arguments: not the same op spelling
        return False
    return _same_meta(got, expected)


def _same_meta(got, expected) -> bool:
    if isinstance(expected, (tuple, list)):
        return (isinstance(got, (tuple, list)) and len(got) == len(expected)
                and all(_same_meta(g, e) for g, e in zip(got, expected)))
    return (
        isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor) and got.shape == expected.shape
        and got.dtype == expected.dtype and got.stride() == expected.stride()
    )


def _is_operator(target) -> bool:
    return getattr(target, "__module__", None) in ("_operator", "operator") and target is not operator.getitem


@register
class Normalize(Pass):
    """Rewrite Tensor methods, operators and stateless leaf modules into torch functions."""

    name = "normalize"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        rewritten: dict[str, int] = {}
        skipped: dict[str, str] = {}
        for node in list(gm.graph.nodes):
            if node.op == "call_method" or (node.op == "call_function" and _is_operator(node.target)):
                args, kwargs = node.args, dict(node.kwargs)
            elif node.op == "call_module":
                module = gm.get_submodule(node.target)
                if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
                    continue
                bound = ops.bind(node, gm)
                if bound is None:
                    continue
                args, kwargs = bound.operands, dict(bound.params)
            else:
                continue
            # Step 1
            op = ops.lookup(node, gm)
            if op is None or op.random or op.mutates:
                continue
            # Step 2
            fn = _canonical_callable(op)
            if fn is None:
                continue
            # Step 3
            if not args or not (isinstance(args[0], torch.fx.Node) and isinstance(args[0].meta.get("val"), torch.Tensor)):
                skipped[node.name] = "first operand is not a tensor"
                continue
            # Step 4
            if not _same_result(fn, args, kwargs, node):
                skipped[node.name] = f"{fn.__name__} does not take these arguments the same way"
                continue
            # Step 5: in place, so the node keeps its name and the dump's diff shows only the spelling
            node.op, node.target = "call_function", fn
            node.args, node.kwargs = tuple(args), kwargs
            rewritten[op.name] = rewritten.get(op.name, 0) + 1
        changed = bool(rewritten)
        return PassResult(gm, changed, {"rewritten": sum(rewritten.values()), "by_op": rewritten, "skipped": skipped})
