"""The fuse pass's last step: a fused cross-entropy over a linear head's logits runs with the head,
over chunks of rows (runtime/chunked_loss.py), so neither the logits of the whole batch nor their
gradient are made where the graph does not use them otherwise.

Algorithm:
  1. Each fused call of a row group with one output, a cross-entropy's mean or sum (no running
     statistics, no mask drawn), whose one full-row input is its logits.
  2. The logits come from a linear (F.linear, an nn.Linear, or the bias-free linear a bias
     epilogue left) computing float32, through reshapes that keep the elements' order and the
     last dim, and float32 casts of float32 values (HF's logits.float()), so the group's rows
     are the head's rows in order. The group's other inputs are made without the logits.
  3. One call ChunkedHeadLoss(h, weight, bias, *the group's other inputs) replaces the group;
     where the head's output has users besides that path (a model returning its logits), the
     call returns the logits too and they read those: they and everything after them move
     after the call, which comes after the group's other inputs.
  4. It stays where the estimate (memory.estimate_peak) puts the step lower: what chunking
     spares, the logits' gradient (and the logits, which the loss keeps for backward, where the
     graph does not use them otherwise), against what it makes in the forward, the gradients of
     the head's input and weight (which outweigh the logits for a head of few classes). Rows per chunk:
     Liger's (chunk_rows: a chunk's logits about as large as the head's input); with a budget
     the recompute pass takes the largest that fits it (head_loss_chunks.py).
"""
from __future__ import annotations

import copy
import operator

import torch.fx

from ... import ops
from ...analysis.memory import size_text
from ...analysis.meta import KEY, tensor_info
from ...codegen.row_group import FULL
from ...runtime.chunked_loss import ChunkedHeadLoss
from ...runtime.fused_row import FusedRowOp
from ..notes import note, notes
from .row_members import StateInput, as_state


def _head_of(value: torch.fx.Node, gm: torch.fx.GraphModule) -> tuple[torch.fx.Node | None, list, str]:
    """Step 2: (the linear, the nodes between it and value, '') or (None, [], why not)."""
    path = []
    node = value
    while True:
        op, info = ops.lookup(node, gm), tensor_info(node)
        if op is None or info is None or not hasattr(info, "dtype"):
            return None, [], f"its logits come from {node.name}, no linear head"
        if op.name == "linear":
            break
        first = node.all_input_nodes[0] if node.all_input_nodes else None
        before = tensor_info(first) if first is not None else None
        keeps = op.keeps_order and before is not None and before.shape[-1:] == info.shape[-1:]
        same_cast = op.name == "to_dtype" and before is not None and before.dtype == info.dtype
        if not (keeps or same_cast):
            return None, [], f"its logits come from {node.name} ({op.name}), which reorders or converts a head's output"
        path.append(node)
        node = first
    if tensor_info(node).dtype != torch.float32:
        return None, [], "the head computes in another dtype than float32"
    return node, path, ""


def _cone(start: torch.fx.Node) -> set[torch.fx.Node]:
    """Every node that reads start's value, directly or not."""
    seen, todo = set(), list(start.users)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return seen


def _chunkable(call: torch.fx.Node, gm: torch.fx.GraphModule):
    """Step 1 and 2: (row op, place of the logits among its inputs, the linear, the path from it) or
    the reason the group stays as it is; None for a call that is no cross-entropy."""
    rows = call.target
    if not isinstance(rows, FusedRowOp) or rows.returned != 1 or rows.finish[0] is None:
        return None
    if rows.finish[0][0] not in ("mean", "sum") or rows.updates or rows.draws:
        return "a cross-entropy per row (reduction='none') or with masks drawn is not chunked"
    full = [i for i, k in enumerate(rows.given) if rows.group.input_kind(k) == FULL]
    if len(full) != 1:
        return "the loss reads more than its logits at full size"
    head, path, why = _head_of(call.args[full[0]], gm)
    if head is None:
        return why
    later = _cone(head)
    if any(a in later for i, a in enumerate(call.args) if i != full[0] and isinstance(a, torch.fx.Node)):
        return "the loss's other inputs are computed from its logits"
    return rows, full[0], head, path


def chunk_heads(gm: torch.fx.GraphModule, peak) -> tuple[list[dict], dict[str, str]]:
    """Steps 1-4 over the graph the fuse pass made: (what was chunked, per loss left whole why).
    peak(module): the estimated peak of its step, which decides."""
    done, declined = [], {}
    for name in [n.name for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, FusedRowOp)]:
        call = next(n for n in gm.graph.nodes if n.name == name)
        found = _chunkable(call, gm)
        if found is None:
            continue
        if isinstance(found, str):
            declined[name] = found
            continue
        # Step 4, on a copy of the graph over the same state
        trial = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        twin = next(n for n in trial.graph.nodes if n.name == name)
        rows, at, head, path = _chunkable(twin, trial)
        record = _rewrite(trial, twin, rows, at, head, path)
        trial.graph.eliminate_dead_code()
        trial.recompile()
        whole, chunked = peak(gm), peak(trial)
        if chunked >= whole:
            declined[name] = (f"run with its head over chunks of rows the step would peak no lower ({size_text(chunked)}, "
                              f"whole {size_text(whole)}): the logits it spares weigh no more than the gradients of the "
                              "head's input and weight it makes in the forward")
            continue
        gm.graph = trial.graph
        gm.recompile()
        done.append({**record, "peak_whole": whole, "peak_chunked": chunked})
    if done:
        gm.graph.lint()
    return done, declined


def _state_node(gm: torch.fx.GraphModule, value, before: torch.fx.Node):
    """A graph node reading value: itself, or a new attribute read for a leaf module's parameter."""
    value = as_state(value, gm)
    if not isinstance(value, StateInput):
        return value
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(value.target)
    node.meta[KEY] = value.info
    return node


def _rewrite(gm: torch.fx.GraphModule, call: torch.fx.Node, rows: FusedRowOp, at: int, head: torch.fx.Node,
             path: list) -> dict:
    """Step 3."""
    graph = gm.graph
    bound = ops.bind(head, gm)
    h = bound.operands[0]
    weight = _state_node(gm, bound.operands[1], call)
    bias = _state_node(gm, bound.operands[2] if len(bound.operands) > 2 else None, call)
    checks = [u for n in [head, *path] for u in n.users if _is_check(u, gm)]
    returns_logits = _returns_logits(head, path, call, gm)
    for u in checks if not returns_logits else ():
        graph.erase_node(u)
    op = ChunkedHeadLoss(rows, at, returns_logits=returns_logits)
    with graph.inserting_before(call):
        fused = graph.call_function(op, (h, weight, bias, *[a for i, a in enumerate(call.args) if i != at]))
    fused.meta = dict(call.meta)
    note(fused, "fuse", f"{notes(call).get('fuse', 'fused')}, with its linear head {head.name}, over chunks of rows")
    loss = fused
    if returns_logits:
        with graph.inserting_after(fused):
            loss = graph.call_function(operator.getitem, (fused, 0))
        with graph.inserting_after(loss):
            logits = graph.call_function(operator.getitem, (fused, 1))
        loss.meta, logits.meta = dict(call.meta), dict(head.meta)
        fused.meta = {k: v for k, v in fused.meta.items() if k not in ("val", "tensor_meta", KEY)}
        # what reads the head's output comes after the call, in order, and reads its logits
        position = {n: i for i, n in enumerate(graph.nodes)}
        movers = sorted((n for n in _cone(head) if n is not call and position[n] < position[fused]),
                        key=position.__getitem__)
        anchor = logits
        for n in movers:
            anchor.append(n)
            anchor = n
        head.replace_all_uses_with(logits)
    call.replace_all_uses_with(loss)
    graph.erase_node(call)
    return {"name": fused.name, "head": head.name, "loss": call.name, "returns_logits": returns_logits,
            "path": [n.name for n in path]}


def _returns_logits(head: torch.fx.Node, path: list, call: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """Whether the head's logits have users besides the loss's path (export's checks of their
    metadata aside: they check a tensor the chunked call makes only if asked)."""
    on_path = set(path) | {call}
    return any(u not in on_path and not _is_check(u, gm) for n in [head, *path] for u in n.users)


def _is_check(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    op = ops.lookup(node, gm)
    return op is not None and op.name == "assert_tensor_metadata" and not node.users
