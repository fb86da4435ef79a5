"""Turn runs of graph nodes into segments recomputed during backward (torch.utils.checkpoint).

Each segment becomes its own GraphModule over the same submodules and parameters, called as
    recompute_segment_k(*inputs) == torch.utils.checkpoint.checkpoint(segment, *inputs, use_reentrant=False)
(runtime/checkpoint.py) so the forward keeps only the segment's inputs. The segment is held by
a plain callable, not registered as a submodule, so the model's parameters(), state_dict() keys
and optimizers are unchanged.

Nodes that change state must run exactly once and cannot be recomputed: in-place writes and
calls the registry does not know, unless their schema declares them functional
(effects.declared_functional) or they are a model's autograd.Function whose forward writes none of
its inputs (effects.function_writes). Two exceptions: BatchNorm in training becomes, in a segment,
batch_norm_once (runtime/checkpoint.py), which updates the running statistics on its first run
only; and an in-place elementwise op writing a tensor the segment itself made (not an input of
it, nor a view of one) writes the same values on each run.

Names stay stable, so the dumps' diff of a plan shows only what it changed: a segment's nodes
keep their names in its GraphModule, the main graph reads each value it uses from the segment
under the name of the node that made it, only the call is new (recompute_segment_k), and
undoing a segment gives its nodes their names back.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ... import ops
from ...analysis.aliases import Aliases
from ...analysis.effects import CALLS, declared_functional, function_writes, may_draw, size_arithmetic, state_effect
from ...analysis.meta import TensorInfo, gather, tensor_info
from ...analysis.segments import SegmentCall
from ...frontend.custom_functions import FunctionCall
from ...runtime.checkpoint import BatchNormOnce, RecomputeSegment, batch_norm_once
from ...runtime.offload import CallOrder, OffloadedSegment
from ..notes import note

_BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


def _once_form(node: torch.fx.Node, gm: torch.fx.GraphModule):
    """(target, args, kwargs) running `node` as batch_norm_once, or None when it is not a
    training batch norm that can run so (SyncBatchNorm and custom subclasses cannot)."""
    op = ops.lookup(node, gm)
    if op is None or op.name != "batch_norm_train":
        return None
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return (BatchNormOnce(module), node.args, node.kwargs) if type(module) in _BATCH_NORMS else None
    if node.op != "call_function":
        return None
    bound = ops.bind(node, gm)
    if bound is None or not all(v is None or isinstance(v, torch.fx.Node) for v in bound.operands):
        return None
    return batch_norm_once, tuple(bound.operands), {"momentum": bound["momentum"], "eps": bound["eps"]}


def recomputable(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str | None:
    """None when the node may run twice with the same effect; otherwise why not."""
    if node.op == "get_attr":
        return None  # stays in the main graph; a segment reads the attribute itself
    if node.op not in CALLS:
        return f"{node.op} nodes stay in the main graph"
    if size_arithmetic(node):
        return None
    why = state_effect(node, gm)
    if why and (_once_form(node, gm) is not None or (ops.lookup(node, gm) is None and declared_functional(node))):
        return None  # the model's own checkpointing reruns such a call too (transformers' grouped_mm_fallback)
    if why and isinstance(node.target, FunctionCall):
        return function_writes(node)  # a model's autograd.Function: as the model's own checkpointing reruns it
    return why


def _writes_inside(node: torch.fx.Node, gm: torch.fx.GraphModule, inside: set, aliases: Aliases) -> bool:
    """Whether node is an in-place elementwise op writing a tensor made in the segment `inside`,
    through views of such a tensor at most. An op that may return its input (a cast) made a
    tensor of its own where the FakeTensor run says so: RoBERTa's position ids, `.long()` of an
    int32 tensor, then `+ padding_idx` written in place."""
    op = ops.lookup(node, gm)
    bound = ops.bind(node, gm) if op is not None and op.inplace_of and op.kind == "elementwise" else None
    x = bound.operands[0] if bound is not None and bound.operands else None
    while isinstance(x, torch.fx.Node) and x in inside and x.op in CALLS:
        made = ops.lookup(x, gm)
        # the FakeTensor run shows x sharing no storage with its inputs
        ran_fresh = aliases.complete and not set(aliases.sharing(x)) & set(x.all_input_nodes)
        if made is None:  # fresh where its schema says its results alias no input, or the run does
            return declared_functional(x) or ran_fresh
        if made.inplace_of:  # its result is the storage it wrote: where that came from
            return _writes_inside(x, gm, inside, aliases)
        if not made.aliases or ran_fresh:
            return True  # a fresh tensor
        x = x.all_input_nodes[0] if x.all_input_nodes else None
    return False


def _segment_module(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]):
    """A GraphModule computing `nodes`, with its inputs and the outputs used outside it."""
    inside = set(nodes)
    used = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes if i not in inside))
    # Attributes are read inside: as checkpoint inputs, a buffer the segment updates (running
    # statistics) would trip autograd's version check on saved inputs.
    inputs = [i for i in used if i.op != "get_attr"]
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph = torch.fx.Graph()
    env, names = {}, {}
    for i in used:
        env[i] = graph.get_attr(i.target) if i.op == "get_attr" else graph.placeholder(i.name)
        env[i].meta = dict(i.meta)
    for n in nodes:
        once = _once_form(n, gm) if state_effect(n, gm) else None
        if once is None:
            env[n] = graph.node_copy(n, lambda x: env[x])
        else:
            target, args, kwargs = once
            remap = lambda a: torch.fx.map_arg(a, lambda x: env[x])  # noqa: E731
            env[n] = graph.call_function(target, remap(args), remap(kwargs))
            env[n].meta = {**n.meta, "recompute_original": (n.op, n.target, remap(n.args), remap(n.kwargs))}
        names[env[n]] = n.name
    _rename(graph, names)
    graph.output(tuple(env[o] for o in outputs))
    # Root gm: call_module and get_attr targets resolve to the same module objects.
    return torch.fx.GraphModule(gm, graph, class_name="RecomputeSegment"), inputs, outputs


def checkpoint_segments(gm: torch.fx.GraphModule, segments: list[list[torch.fx.Node]],
                        selective: list[bool] | None = None, offload: bool = False) -> torch.fx.GraphModule:
    """Rewrite gm so each segment (nodes contiguous in graph order) is recomputed in backward;
    selective[k]: segment k keeps its matmul, convolution and attention outputs; offload: each
    full segment whose outputs are tensors keeps its inputs on the host until its backward
    (runtime/offload.py)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    selective = selective or [False] * len(segments)
    calls = CallOrder()  # the offloaded segments' backward brings the next one's inputs up
    for k, nodes in enumerate(segments):
        nodes = [n for n in sorted(nodes, key=order.__getitem__) if n.op != "get_attr"]
        if not nodes:
            continue
        inside, aliases = set(nodes), None
        for n in nodes:
            why = recomputable(n, gm)
            if why:
                aliases = aliases or Aliases(gm)  # a pass over the graph: only for a node that asks
                if not _writes_inside(n, gm, inside, aliases):
                    raise ValueError(f"node {n.name} cannot be recomputed: {why}")
        module, inputs, outputs = _segment_module(gm, nodes)
        inside, last = set(nodes), nodes[-1]
        with gm.graph.inserting_after(last):
            draws = any(may_draw(n, gm) for n in nodes)
            whole = all(map(_returned_whole, outputs))
            runs = OffloadedSegment(k, module, draws, calls) if offload and not selective[k] and whole else \
                RecomputeSegment(k, module, selective[k], draws)
            call = gm.graph.call_function(runs, tuple(inputs))
        items = {}
        with gm.graph.inserting_after(call):
            for j, out in enumerate(outputs):
                item = gm.graph.call_function(operator.getitem, (call, j))
                # its own notes: the pass marks it a boundary, its copy in the segment is recomputed or not
                item.meta = {k: dict(v) if isinstance(v, dict) else v for k, v in out.meta.items()}
                out.replace_all_uses_with(item, delete_user_cb=lambda user, inside=inside: user not in inside)
                items[item] = out.name
        gather(call, outputs, single=False)  # it returns what its outputs made: no FakeTensor run needed
        # the dumps label a segment by the source line it starts at, not its first output's
        call.meta["stack_trace"] = next((n.meta["stack_trace"] for n in nodes if n.meta.get("stack_trace")), None)
        for n in reversed(nodes):
            gm.graph.erase_node(n)
        # the names are free only now that the segment's nodes are gone
        _rename(gm.graph, {call: f"recompute_segment_{k}", **items})
    gm.graph.lint()
    gm.recompile()
    return gm


def _returned_whole(node: torch.fx.Node) -> bool:
    """Whether an autograd.Function returning node's value sees every tensor in it: a tensor, or a
    number (a size); not a tuple of tensors nor a model's output dataclass, whose tensors it would
    hand on without their gradients."""
    return isinstance(tensor_info(node), TensorInfo) or isinstance(node.meta.get("val"), (int, float, torch.SymInt))


def inline_segments(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Undo checkpoint_segments: put every segment's nodes back into gm's graph."""
    attrs = {n.target: n for n in gm.graph.nodes if n.op == "get_attr"}  # still there: the segment read them
    for call in [n for n in gm.graph.nodes if isinstance(n.target, SegmentCall)]:
        seg = call.target.module
        env = dict(zip([p for p in seg.graph.nodes if p.op == "placeholder"], call.args))
        env.update((n, attrs[n.target]) for n in seg.graph.nodes if n.op == "get_attr")
        copies = {}
        with gm.graph.inserting_before(call):
            for node in seg.graph.nodes:
                if node.op == "output":
                    results = [env[o] for o in node.args[0]]
                    continue
                if "recompute_original" in node.meta:  # batch_norm_once: back to the original call
                    op, target, args, kwargs = node.meta["recompute_original"]
                    remap = lambda a, env=env: torch.fx.map_arg(a, lambda x: env[x])  # noqa: E731
                    env[node] = gm.graph.create_node(op, target, remap(args), remap(kwargs))
                    env[node].meta = {k: v for k, v in node.meta.items() if k != "recompute_original"}
                elif node.op not in ("placeholder", "get_attr"):
                    env[node] = gm.graph.node_copy(node, lambda x, env=env: env[x])
                else:
                    continue
                copies[env[node]] = node.name
        for item in list(call.users):
            item.replace_all_uses_with(results[item.args[1]])
            gm.graph.erase_node(item)
        gm.graph.erase_node(call)
        # the getitems that held the outputs' names are gone: every node gets its name back
        _rename(gm.graph, copies)
    gm.graph.lint()
    gm.recompile()
    return gm


def _rename(graph: torch.fx.Graph, names: dict[torch.fx.Node, str]) -> None:
    """Give each node its name in `names` where no other node of the graph has it. fx never hands
    out a name twice, even one whose node was erased, so the name is set on the node directly."""
    taken = {n.name for n in graph.nodes}
    for node, name in names.items():
        if node.name != name and name not in taken:
            taken.discard(node.name)
            node.name = name
            taken.add(name)


def note_segments(gm: torch.fx.GraphModule) -> None:
    """Each segment call and its boundary inputs noted, for the dumps."""
    for n in gm.graph.nodes:
        if isinstance(n.target, SegmentCall):
            kind = " (selective)" if n.target.selective else " (its inputs on the host)" if n.target.offloaded else ""
            note(n, "recompute", f"segment {n.target.index}{kind}")
            for i in n.all_input_nodes:
                if i.op.startswith("call"):
                    note(i, "recompute", "boundary")

