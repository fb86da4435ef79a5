"""inplace: run elementwise ops in place, into an input whose storage is dead afterwards.

Algorithm:
  1. Record one FakeTensor forward (analysis/saved.py): which node's output owns each storage, the
     last node that reads each storage (views included), and, in training, every storage
     autograd saves for backward. The graph's returned tensors are live to the end.
  2. Each elementwise node with an in-place twin (registry: OpInfo.inplace) is a candidate
     to write into its first operand x. It is rewritten when
       a. x is a tensor made by a call node of this graph (not an input, parameter or buffer,
          nor a view of one), and the result has x's shape, dtype and strides (no broadcast,
          no promotion);
       b. x's storage is not read after this node (no later use of x or of a view of it),
          is not returned, and no other operand of the node shares it;
       c. in training, autograd saves nothing in x's storage: no node's backward, this
          node's included, needs the values the write would destroy. Measured, not guessed:
          sigmoid saves its output, so relu on sigmoid's output stays out of place. Nor is x a
          view autograd tracks (a linear's 3-d output is a view of its 2-d matmul): a write into
          one makes autograd's backward copy the base's whole gradient, and the view's, which
          can cost more than the write saves (a residual add into a linear's output raises the
          peak it was meant to lower).
       d. nothing reads x's storage again after the forward: with a budget, the recompute
          pass runs these steps within its plan, where a segment's rerun reads its inputs again
          in backward (recompute/in_place.py).
     In inference (train=False) nothing is saved for backward, so c does not apply: ops whose
     backward would need their input (mul, silu, sigmoid's output read by a later op...) may
     write in place too. Unless the pass runs by default (optimize() given no passes): a model
     in eval mode may still be differentiated (fine-tuning without dropout), and a write only
     inference allows would break its backward, so c holds then too.
  3. Rewrite each into aten's in-place twin (ops.twins.inplace_call), in graph order; its
     result replaces the node's. Nodes keep their metadata: an in-place result has the
     shape, dtype and strides it had.
  4. Report the rewritten ops, the estimated peak before and after (memory.estimate_peak),
     and each candidate left alone with its reason. Where the writes raise the estimated peak
     (autograd copying around a write, as in 2c, where no rule foresaw it), none is made.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from .. import ops
from ..analysis.effects import state_effect
from ..analysis.memory import estimate_peak, output_tensors
from ..analysis.meta import tensor_info
from ..analysis.saved import StepFacts, record_step
from ..ops.twins import inplace_call
from .base import Pass, PassContext, PassResult
from .notes import note
from .registry import register


@dataclass
class _Step:
    """What one recorded forward says (step 1)."""

    facts: StepFacts
    order: dict       # node -> position
    last_use: dict    # storage -> position of the last node that reads it
    returned: set     # storages the graph returns
    saved: set        # storages autograd saves for backward
    inputs: set       # names of the placeholders

    @classmethod
    def record(cls, gm: torch.fx.GraphModule, facts: StepFacts) -> _Step:
        nodes = list(gm.graph.nodes)
        _, last_use = facts.lifetimes(nodes)
        return cls(facts, {n: i for i, n in enumerate(nodes)}, last_use,
                   {k for m in output_tensors(gm) for k, _ in facts.storages.get(m.name, [])},
                   {s.storage for items in facts.saved.values() for s in items},
                   {n.name for n in nodes if n.op == "placeholder"})


def _why_not(n: torch.fx.Node, gm: torch.fx.GraphModule, step: _Step, train: bool, reread: dict):
    """(None, call) when node n may write into its first operand; (reason, None) otherwise."""
    if state_effect(n, gm):
        return "changes state", None
    bound = ops.bind(n, gm)
    call = inplace_call(bound) if bound is not None else None
    if call is None:
        return "aten has no in-place form of it", None
    x = bound.operands[0]
    if not isinstance(x, torch.fx.Node):
        return "its first operand is not a graph tensor", None
    # Step 2a
    keys = step.facts.storages.get(x.name, [])
    if len(keys) != 1:
        return "its first operand is not a single tensor", None
    key = keys[0][0]
    kind, owner = step.facts.owner.get(key, ("state", ""))
    if kind != "node" or owner in step.inputs:
        return "its first operand is a graph input, parameter or buffer (or a view of one)", None
    mine, theirs = tensor_info(n), tensor_info(x)
    if mine is None or theirs is None or (mine.shape, mine.dtype, mine.stride) != (theirs.shape, theirs.dtype, theirs.stride):
        return "its result differs from its first operand in shape, dtype or strides", None
    # Step 2b
    if step.last_use.get(key, -1) > step.order[n] or key in step.returned:
        return f"{x.name} (or a view of it) is used later", None
    if key in reread:
        return f"{x.name} (or a view of it) {reread[key]}", None
    others = [o for o in bound.operands[1:] if isinstance(o, torch.fx.Node)]
    if any(k == key for o in others for k, _ in step.facts.storages.get(o.name, [])):
        return "another operand shares its first operand's storage", None
    # Step 2c
    if train and key in step.saved:
        return f"autograd saves {x.name} (or a view of it) for backward", None
    if train and x.name in step.facts.tracked_views:
        return (f"{x.name} is a view autograd tracks: writing into it, autograd's backward copies its base's "
                "whole gradient (CopySlices)"), None
    return None, call


def plan_writes(gm: torch.fx.GraphModule, facts: StepFacts, train: bool, reread: dict | None = None):
    """Step 2: ([(node, op, in-place call)] to rewrite, {node name: why not}). reread: storages
    read again after the forward, by key, each with the reason (a recompute segment's inputs)."""
    step = _Step.record(gm, facts)
    rewrites, skipped = [], {}
    for n in list(gm.graph.nodes):
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        op = ops.lookup(n, gm)
        if op is None or op.kind != "elementwise" or not op.inplace:
            continue
        why, call = _why_not(n, gm, step, train, reread or {})
        if why:
            skipped[n.name] = why
            note(n, "inplace", f"no: {why}")
        else:
            rewrites.append((n, op, call))
    return rewrites, skipped


def written_as(op) -> str:
    """How a write is reported and kept (the plan cache's entries): "add -> add_"."""
    return f"{op.name} -> {op.inplace}"


def write_in_place(gm: torch.fx.GraphModule, rewrites: list) -> dict:
    """Step 3: each rewrite done, in graph order, each node replaced where it stands; {name: how}."""
    done, replaced = {}, {}
    for n, op, (target, args, kwargs) in rewrites:
        # arguments were bound before earlier rewrites replaced their nodes
        current = lambda a: replaced.get(a, a)  # noqa: E731
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(target, torch.fx.map_arg(args, current),
                                         torch.fx.map_arg(kwargs, current))
        replaced[n] = new
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        new.name = n.name
        note(new, "inplace", written_as(op))
        done[new.name] = written_as(op)
    gm.graph.lint()
    gm.recompile()
    return done


@register
class Inplace(Pass):
    """Run elementwise ops in place when their input's storage is dead and autograd allows it."""

    name = "inplace"
    runs_after = {"precision": "an in-place write keeps its target's dtype, so a write decided in float32 and "
                          "narrowed to bf16/fp16 afterwards rounds what torch.autocast keeps in float32"}
    writes_in_place = True

    def skip_by_default(self, gm, ctx, pipeline):
        # A value written in place is no longer there to run a segment again: the least budget rises.
        planned = next((f"a budget is planned: {p.plans_memory}" for p in pipeline if p.plans_memory), None)
        # FSDP2 hands a unit its inputs as views of one autograd function's outputs, which refuses
        # an in-place write into them (seen on transformers' Llama with fused kernels)
        units = "the blocks become FSDP units (shard), whose inputs take no write in place" if ctx.units else None
        return planned or units

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        # Steps 1 and 2
        rewrites, skipped = plan_writes(gm, ctx.analysis(record_step, gm), ctx.train or self.by_default)
        if not rewrites:
            return PassResult(gm, False, {"rewritten": {}, "skipped": skipped})
        before = ctx.analysis(estimate_peak, gm, train=ctx.train).peak_bytes
        # Step 3
        kept = _copy(gm.graph)
        done = write_in_place(gm, rewrites)
        # Step 4
        after = ctx.analysis(estimate_peak, gm, train=ctx.train).peak_bytes
        if after > before:  # the writes raise the peak (autograd copies around them): not made
            gm.graph = kept
            gm.recompile()
            skipped = {**skipped, **{name: f"written in place with the others, they raise the estimated peak from "
                                           f"{before} to {after} bytes" for name in done}}
            return PassResult(gm, False, {"rewritten": {}, "skipped": skipped, "peak_before_bytes": before,
                                          "saved_bytes": 0})
        return PassResult(gm, True, {"rewritten": done, "skipped": skipped, "peak_before_bytes": before,
                                     "saved_bytes": before - after}, peak_bytes=after)


def _copy(graph: torch.fx.Graph) -> torch.fx.Graph:
    """The graph as it is, nodes' names and metadata kept, to go back to."""
    copied = torch.fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    copied._codegen = graph._codegen
    output = copied.graph_copy(graph, {})
    copied.output(output)
    return copied
