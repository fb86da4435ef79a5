"""Facts about a graph, computed once per version of it and shared by the passes that ask.

An analysis is a function (gm, flat_inputs, **settings) -> fact: memory.estimate_peak,
saved.record_step, cost.node_times. Passes ask the pass context for it
(ctx.analysis(record_step, gm)) instead of calling it, so a fact one pass computed is not
computed again by the next while the graph is the same: inplace's peak after its rewrite is
recompute's peak before.

The same graph means the same version (graph_version): the nodes in order with their ops,
targets, arguments and leaf modules, and the dtype, shape and device of every parameter and
buffer (the precision pass changes those without touching the graph). A fact is recomputed
whenever the version it was computed for is not the graph's now, so a pass that rewrites the
graph and asks again gets the new graph's fact whether or not it says it changed anything;
the pass manager drops every fact when a pass reports `changed`, which frees them early.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.fx


def graph_version(gm: torch.fx.GraphModule) -> tuple:
    """What an analysis's answer depends on, comparable with ==. Targets and modules are held
    by identity (a recompute segment is a new object each time a plan is rewritten)."""
    nodes = tuple(
        (n.op, n.name, n.target, gm.get_submodule(n.target) if n.op == "call_module" else None,
         str(n.args), str(n.kwargs))
        for n in gm.graph.nodes
    )
    state = tuple((name, t.dtype, tuple(t.shape), t.device, t.requires_grad)
                  for name, t in [*gm.named_parameters(remove_duplicate=False),
                                  *gm.named_buffers(remove_duplicate=False)])
    return id(gm), nodes, state


class Analyses:
    """The facts computed so far, one per analysis and settings, for the graph version each
    was computed on."""

    def __init__(self, inputs_of: Callable[[torch.fx.GraphModule], list]):
        self.inputs_of = inputs_of  # the example inputs as gm's placeholders take them
        self.facts: dict[tuple, tuple[tuple, Any]] = {}
        self.computed: dict[str, int] = {}  # analysis name -> times computed (the report's count)

    def get(self, analysis: Callable, gm: torch.fx.GraphModule, **settings) -> Any:
        # Settings left out are the analysis's defaults: the same call however it is spelled.
        bound = inspect.signature(analysis).bind(gm, None, **settings)
        bound.apply_defaults()
        key = (analysis, tuple(bound.arguments.items())[2:])
        version = graph_version(gm)
        held = self.facts.get(key)
        if held is not None and held[0] == version:
            return held[1]
        fact = analysis(gm, self.inputs_of(gm), **settings)
        self.facts[key] = (version, fact)
        self.computed[analysis.__name__] = self.computed.get(analysis.__name__, 0) + 1
        return fact

    def drop(self) -> None:
        self.facts.clear()
