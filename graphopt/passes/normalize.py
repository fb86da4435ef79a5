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
  6. Functionalize: an in-place op (the registry's twin of an out-of-place op: `x.relu_()`,
     `nn.SiLU(inplace=True)`, `F.relu(x, inplace=True)`, `x.add_(y)`, aten.hardswish_) that
     writes into a tensor x no one else can see (aliases.py: x is one tensor the graph made,
     not an input, parameter or buffer nor a view of one, and every other tensor sharing its
     storage is dead by then) becomes its out-of-place op, checked on FakeTensors as in step 4;
     later readers of x read the result instead. Eager computes the same values either way, and
     later passes see a pure op: cse may merge it, fuse may take it in, recompute may run it
     again; the inplace pass puts writes back where autograd allows.
  7. Causal masks: an attention mask the graph builds from its inputs' sizes alone, causal at
     the example's sizes, becomes is_causal=True (causal_masks.py says why, and how other sizes
     are checked at call time).
  8. Identities: a dropout with p=0, or in eval mode, returns its input tensor itself and draws
     nothing (ATen's dropout), an nn.Identity returns its input (timm's empty drop-block and
     anti-aliasing slots), and a reshape to the shape its input has (NFNet's `.view(-1)` of a
     vector) or a contiguous() of a contiguous tensor reads it as it is laid out (detach is
     kept: it cuts the gradient), and a slice of a whole dimension (export spells `x[:, :, i]` as
     full slices around a select, and each slice's backward writes a zeroed copy of the whole
     input); where the FakeTensor run shows the result sharing the input's storage, offset, shape
     and strides, its uses read the input, and the node goes.
     Later passes then see the ops around it as neighbours (fuse, recompute, step 9:
     a dynamic sequence length keeps repeat_kv's `k[:, :, None]` as whole slices).
  9. Grouped-query attention: scaled_dot_product_attention reading keys and values whose heads
     were repeated in the graph (transformers' repeat_kv: unsqueeze at dim 2, expand that
     dim, reshape it into the heads) reads them unrepeated with enable_gqa=True, which repeats
     the heads the same way inside the kernel. Eager transformers models do this themselves
     when they pass no mask; an exported graph carries the mask, so it materializes the
     repeated keys and values, saves them for backward and sums their gradients back. Only
     where the kernel takes it: on CPU, and on CUDA without a mask (CUDA's kernels that take a
     mask do not take enable_gqa, and SDPA would fall back to its slow math path).
  10. Stochastic depth: torchvision's stochastic_depth (a function fx keeps whole) is spelled out
     as the ops it runs, the ops timm's drop_path is traced into: in training with p > 0,
     x * torch.bernoulli(x.new_empty((N, 1, ..., 1)), 1 - p) / (1 - p) (ATen's functional
     bernoulli draws into an empty_like of its input: the same draws as the function's
     bernoulli_ into its torch.empty); else x itself, as the function returns it. Fuse then
     takes the noise, the divide and the product into the group around them.
  11. Mixture-of-experts matmuls: transformers' grouped matmul fallback, which it traces in
     place of the torch._grouped_mm its eager step runs, calls torch._grouped_mm again where
     the real kernel takes the operands (grouped_experts.py says why).
  12. Buffers filled piecewise: an uninitialized tensor whose slices along one dimension tile it,
     each written once by a copy, before anything reads it, is the cat of what was copied
     (filled_buffers.py): no write is left to cut recompute's segments.

Modules with parameters or buffers, and random ops, keep their spelling: their state and
train/eval behaviour live in the module.
"""
from __future__ import annotations

import inspect
import operator

import torch
import torch.fx
import torch.nn.functional as F

from .. import ops
from ..analysis import meta
from ..analysis.aliases import Aliases, storage_key
from ..analysis.effects import is_identity_dropout
from .base import Pass, PassContext, PassResult
from .causal_masks import causal_masks, op_name
from .filled_buffers import cat_filled_buffers
from .grouped_experts import eager_grouped_mm
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


def _differentiable(fn, args, kwargs, node) -> bool:
    """Whether autograd differentiates fn's call where gradients flow through the node: some
    out-of-place twins have no derivative (aten.copy, copy_'s twin, which export spells where
    a batch of one row lets a slice assignment write a whole tensor), and their forward runs
    and records a grad_fn that raises only in backward."""
    info = meta.tensor_info(node)
    if not any(i.requires_grad for i in meta.leaves(info)):
        return True

    def tracked(value):
        if isinstance(value, (list, tuple)):
            return type(value)(tracked(v) for v in value)
        fake = _fake(value)
        if isinstance(value, torch.fx.Node) and isinstance(fake, torch.Tensor) and fake.is_floating_point() and any(
                i.requires_grad for i in meta.leaves(meta.tensor_info(value))):
            return fake.detach().requires_grad_(True)
        return fake

    expected = node.meta.get("val")
    first = expected[0] if isinstance(expected, (tuple, list)) and expected else expected
    try:
        with first.fake_mode, torch.enable_grad():
            got = fn(*tracked(tuple(args)), **{k: tracked(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 (a call that does not take grad-tracked operands is not taken)
        return False
    outs = got if isinstance(got, (tuple, list)) else (got,)
    return not any(isinstance(o, torch.Tensor) and type(o.grad_fn).__name__ == "NotImplemented" for o in outs)


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


def _out_of_place(node: torch.fx.Node, gm: torch.fx.GraphModule, op):
    """The out-of-place call for an in-place node: (target, args, kwargs), or None."""
    pure = ops.canonical_ops().get(op.inplace_of)
    if pure is None:
        return None
    if isinstance(node.target, torch._ops.OpOverload):  # aten graphs stay aten: the same overload, out of place
        packet = getattr(torch.ops.aten, pure.name, None)
        overload = getattr(packet, node.target._overloadname, None) if packet is not None else None
        return (overload, node.args, dict(node.kwargs)) if overload is not None else None
    fn = _canonical_callable(pure)
    bound = ops.bind(node, gm)
    if fn is None or bound is None:
        return None
    return fn, tuple(bound.operands), dict(bound.params)


def _functionalize(gm: torch.fx.GraphModule) -> tuple[dict, dict]:
    """Step 6: (rewritten ops by name, {node: why it stays in place})."""
    aliases = Aliases(gm)
    rewritten, kept = {}, {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        op = ops.lookup(node, gm)
        if op is None or not op.inplace_of:
            continue
        call = _out_of_place(node, gm, op)
        if call is None:
            kept[node.name] = f"{op.name} has no out-of-place call in torch"
            continue
        target, args, kwargs = call
        x = args[0] if args else None
        if not isinstance(x, torch.fx.Node):
            kept[node.name] = "its first operand is not a graph tensor"
            continue
        why = aliases.why_not_private(x, node)
        if why is None and not _same_result(target, args, kwargs, node):
            why = "its out-of-place form gives another shape, dtype or strides"
        if why is None and not _differentiable(target, args, kwargs, node):
            why = f"autograd has no derivative for its out-of-place form, {target}"
        if why is not None:
            kept[node.name] = why
            continue
        for user in list(x.users):
            if order[user] > order[node]:  # they read x after the write: its new value is the result
                user.replace_input_with(x, node)
        node.op, node.target, node.args, node.kwargs = "call_function", target, tuple(args), kwargs
        rewritten.setdefault(op.inplace_of, []).append(node)
    for node in (n for nodes in rewritten.values() for n in nodes):
        meta.invalidate(node)  # its FakeTensor still aliases x (its shape served the checks above): re-annotate
    return {name: len(nodes) for name, nodes in rewritten.items()}, kept


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
        # Step 6
        functional, in_place = _functionalize(gm)
        # Step 7
        causal, check = causal_masks(gm, ctx)
        # Step 8
        dropouts = _identity_dropouts(gm)
        # Step 9
        grouped = _grouped_query_attention(gm)
        # Step 10
        depths = _stochastic_depths(gm)
        # Step 11
        experts = eager_grouped_mm(gm)
        # Step 12
        filled = cat_filled_buffers(gm)
        changed = bool(rewritten or functional or causal or grouped or dropouts or depths or experts or filled)
        return PassResult(gm, changed, {"rewritten": sum(rewritten.values()), "by_op": rewritten, "skipped": skipped,
                                        "functionalized": functional, "kept_in_place": in_place,
                                        "causal_masks": causal, "grouped_query_attention": grouped,
                                        "identity_dropouts": dropouts, "stochastic_depths": depths,
                                        "grouped_matmuls": experts, "filled_buffers": filled},
                          call_checks=[check] if check else [])




def _identity_dropouts(gm: torch.fx.GraphModule) -> int:
    """Step 8; the number of dropouts and identities removed."""
    removed = 0
    for node in list(gm.graph.nodes):
        op = ops.lookup(node, gm) if node.op.startswith("call") else None
        # views that may read their input as it is laid out (detach, a view too, cuts the gradient)
        if op is None or not (op.random or op.keeps_order or op.name in ("alias", "contiguous", "slice")):
            continue
        bound = ops.bind(node, gm)
        if bound is None or (op.random and not is_identity_dropout(op, bound.params)):
            continue
        if op.name == "slice" and not _whole_slice(bound.params):
            continue
        x = bound.operands[0]
        if isinstance(x, torch.fx.Node) and _same_tensor(node.meta.get("val"), x.meta.get("val")):
            node.replace_all_uses_with(x)
            gm.graph.erase_node(node)
            removed += 1
    if removed:
        gm.recompile()
    return removed


def _whole_slice(params: dict) -> bool:
    """Whether a slice takes its dimension whole at any size: `x[:, :, i]` exports as slices from 0
    to the largest int64 around the select. A literal end that equals the example's size would
    cut another batch, so only the open end counts."""
    start, end, step = params.get("start"), params.get("end"), params.get("step", 1)
    return start in (None, 0) and step == 1 and (end is None or (isinstance(end, int) and end >= 2**63 - 1))


def _same_tensor(a, b) -> bool:
    """Whether two FakeTensors are one tensor as far as any reader can tell."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.layout == b.layout == torch.strided
            and storage_key(a) == storage_key(b) and a.storage_offset() == b.storage_offset()
            and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


def _repeated_heads(node, gm: torch.fx.GraphModule):
    """(the tensor whose heads `node` repeats as repeat_kv does, (batch, kv heads, seq, dim) ->
    (batch, kv heads * r, seq, dim) with each head r times in a row, and the nodes that repeat
    them); None for anything else."""
    if not isinstance(node, torch.fx.Node) or op_name(node, gm) not in ("reshape", "view"):
        return None
    expanded = node.all_input_nodes[0] if node.all_input_nodes else None
    if expanded is None or op_name(expanded, gm) != "expand":
        return None
    unsqueezed = expanded.all_input_nodes[0]
    if op_name(unsqueezed, gm) != "unsqueeze" and not _adds_dims(unsqueezed):
        return None
    base = unsqueezed.all_input_nodes[0]
    shapes = [getattr(meta.tensor_info(n), "shape", None) for n in (base, unsqueezed, expanded, node)]
    if any(s is None for s in shapes):
        return None
    # Inserting a size-1 dimension anywhere keeps the elements' order: the shapes say it all.
    b, u, e, out = shapes
    if len(b) != 4 or u != (b[0], b[1], 1, b[2], b[3]) or len(e) != 5 or e[:2] != b[:2] or e[3:] != b[2:]:
        return None
    return (base, (node, expanded, unsqueezed)) if out == (b[0], b[1] * e[2], b[2], b[3]) else None


def _adds_dims(node: torch.fx.Node) -> bool:
    """x[:, :, None] and the like: indexing that only inserts size-1 dimensions."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[1], tuple):
        return False
    return all(i is None or i is Ellipsis or i == slice(None) for i in node.args[1])


def _grouped_query_attention(gm: torch.fx.GraphModule) -> int:
    """Step 9; the number of attention calls rewritten."""
    done = 0
    for node in list(gm.graph.nodes):
        if op_name(node, gm) != "scaled_dot_product_attention":
            continue
        bound = ops.bind(node, gm)
        if bound is None or bound.params.get("enable_gqa"):
            continue
        query, key, value, mask = bound["query"], bound["key"], bound["value"], bound["attn_mask"]
        device = getattr(meta.tensor_info(query), "device", None) if isinstance(query, torch.fx.Node) else None
        if device is None or not (device.type == "cpu" or (device.type == "cuda" and mask is None)):
            continue
        k, v = _repeated_heads(key, gm), _repeated_heads(value, gm)
        heads = [getattr(meta.tensor_info(n), "shape", (None,) * 3)[-3] for n in (query, key, value)]
        if k is None or v is None or key is value or len(set(heads)) != 1:
            continue  # query heads broadcast against the keys' are not grouped-query attention
        node.replace_input_with(key, k[0])
        node.replace_input_with(value, v[0])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        for dead in (*k[1], *v[1]):
            if not dead.users:
                gm.graph.erase_node(dead)
        done += 1
    if done:
        gm.recompile()
    return done


def _stochastic_depth_args(node: torch.fx.Node):
    """(x, p, mode, training) of a call of torchvision's stochastic_depth with a graph tensor and
    constant settings it accepts; None for any other node (a bad setting raises at run time,
    as torchvision's own check does)."""
    target = node.target if node.op == "call_function" else None
    if getattr(target, "__module__", None) != "torchvision.ops.stochastic_depth" \
            or getattr(target, "__name__", None) != "stochastic_depth":
        return None
    try:
        bound = inspect.signature(target).bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    x, p, mode, training = bound.args
    if not isinstance(x, torch.fx.Node) or not isinstance(meta.tensor_info(x), meta.TensorInfo):
        return None
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1 or mode not in ("batch", "row") \
            or not isinstance(training, bool):
        return None
    return x, float(p), mode, training


def _stochastic_depths(gm: torch.fx.GraphModule) -> int:
    """Step 10; the number of stochastic depth calls spelled out or removed."""
    done = 0
    graph = gm.graph
    for node in list(graph.nodes):
        found = _stochastic_depth_args(node)
        if found is None:
            continue
        x, p, mode, training = found
        result = x
        if training and p > 0:
            keep = 1.0 - p
            rank = len(meta.tensor_info(x).shape)
            with graph.inserting_before(node):
                size = (graph.call_method("size", (x, 0)),) + (1,) * (rank - 1) if mode == "row" else (1,) * rank
                noise = graph.call_function(torch.bernoulli, (graph.call_method("new_empty", (x, size)),), {"p": keep})
                if keep > 0:
                    noise = graph.call_function(torch.div, (noise, keep))
                result = graph.call_function(torch.mul, (x, noise))
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        done += 1
    if done:
        gm.recompile()
    return done
