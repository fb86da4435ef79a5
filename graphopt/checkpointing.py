"""Turn runs of graph nodes into segments recomputed during backward (torch.utils.checkpoint).

Each segment becomes its own GraphModule over the same submodules and parameters, called as
    recompute_segment_k(*inputs) == torch.utils.checkpoint.checkpoint(segment, *inputs, use_reentrant=False)
so the forward keeps only the segment's inputs, and the backward runs it again with the RNG
state of the first run (dropout draws the same mask). The segment is held by a plain callable,
not registered as a submodule, so the model's parameters(), state_dict() keys and optimizers
are unchanged.

Nodes that change state must run exactly once and cannot be recomputed: BatchNorm in training
(its running statistics), in-place writes, and calls the registry does not know.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint

from .meta import tensor_info
from .purity import CALLS, state_effect


class RecomputeSegment:
    """The callable a rewritten graph calls for segment k."""

    def __init__(self, index: int, module: torch.fx.GraphModule):
        self.index, self.module = index, module
        self.__name__ = self.__qualname__ = f"recompute_segment_{index}"
        self.__module__ = __name__

    def __call__(self, *args):
        return checkpoint(self.module, *args, use_reentrant=False)


def recomputable(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str | None:
    """None when the node may run twice with the same effect; otherwise why not."""
    if node.op not in CALLS:
        return f"{node.op} nodes stay in the main graph"
    if tensor_info(node) is None and (node.target is getattr or getattr(node.target, "__module__", None) == "_operator"):
        return None  # Python arithmetic on sizes (x.shape[1], c // heads): pure
    return state_effect(node, gm)


def _segment_module(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]):
    """A GraphModule computing `nodes`, with its inputs and the outputs used outside it."""
    inside = set(nodes)
    inputs = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes if i not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph = torch.fx.Graph()
    env = {}
    for i in inputs:
        env[i] = graph.placeholder(i.name)
        env[i].meta = dict(i.meta)
    for n in nodes:
        env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(tuple(env[o] for o in outputs))
    # Root gm: call_module and get_attr targets resolve to the same module objects.
    return torch.fx.GraphModule(gm, graph, class_name="RecomputeSegment"), inputs, outputs


def checkpoint_segments(gm: torch.fx.GraphModule, segments: list[list[torch.fx.Node]]) -> torch.fx.GraphModule:
    """Rewrite gm so each segment (nodes contiguous in graph order) is recomputed in backward."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for k, nodes in enumerate(segments):
        nodes = sorted(nodes, key=order.__getitem__)
        for n in nodes:
            why = recomputable(n, gm)
            if why:
                raise ValueError(f"node {n.name} cannot be recomputed: {why}")
        module, inputs, outputs = _segment_module(gm, nodes)
        inside, last = set(nodes), nodes[-1]
        with gm.graph.inserting_after(last):
            call = gm.graph.call_function(RecomputeSegment(k, module), tuple(inputs))
        with gm.graph.inserting_after(call):
            for j, out in enumerate(outputs):
                item = gm.graph.call_function(operator.getitem, (call, j))
                item.meta = dict(out.meta)
                out.replace_all_uses_with(item, delete_user_cb=lambda user, inside=inside: user not in inside)
        for n in reversed(nodes):
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    return gm


def segment_code(gm: torch.fx.GraphModule) -> str:
    """Readable code of every recompute segment gm calls, for the dumps."""
    parts = []
    for n in gm.graph.nodes:
        if isinstance(n.target, RecomputeSegment):
            seg = n.target
            parts.append(f"# {seg.__name__}: recomputed during backward\n"
                         + seg.module.print_readable(print_output=False))
    return "\n".join(parts)


def inline_segments(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Undo checkpoint_segments: put every segment's nodes back into gm's graph."""
    for call in [n for n in gm.graph.nodes if isinstance(n.target, RecomputeSegment)]:
        seg = call.target.module
        env = dict(zip([p for p in seg.graph.nodes if p.op == "placeholder"], call.args))
        with gm.graph.inserting_before(call):
            for node in seg.graph.nodes:
                if node.op == "output":
                    results = [env[o] for o in node.args[0]]
                elif node.op != "placeholder":
                    env[node] = gm.graph.node_copy(node, lambda x, env=env: env[x])
        for item in list(call.users):
            item.replace_all_uses_with(results[item.args[1]])
            gm.graph.erase_node(item)
        gm.graph.erase_node(call)
    gm.graph.lint()
    gm.recompile()
    return gm
