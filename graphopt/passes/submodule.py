"""A run of a graph's nodes as a GraphModule of its own, over the same modules and parameters:
what the pipeline pass makes its stages of and the shard pass its units."""
from __future__ import annotations

import torch.fx


def stage_module(gm, inputs, body, outputs, first: bool = False, class_name: str = "Stage") -> torch.fx.GraphModule:
    """A GraphModule running `body` (nodes of gm, in order) from `inputs` to `outputs` (None: body
    ends with gm's output node); an attribute not among the inputs is read where it is used."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i in inputs:
        # the first stage takes the graph's own inputs (defaults included); later ones, values
        env[i] = graph.node_copy(i) if first else graph.placeholder(i.name)
        env[i].meta = dict(i.meta)

    def value(n):
        if n not in env and n.op == "get_attr":  # read where used
            env[n] = graph.node_copy(n)
        return env[n]

    for n in body:
        if n.op == "output":
            graph.output(torch.fx.map_arg(n.args[0], value))
            continue
        for i in n.all_input_nodes:
            value(i)
        env[n] = graph.node_copy(n, value)
    if outputs is not None:
        graph.output(tuple(env[o] for o in outputs))
    # Root gm: call_module and get_attr targets resolve to the same module and Parameter objects.
    return torch.fx.GraphModule(gm, graph, class_name=class_name)
