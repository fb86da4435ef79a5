"""Rewrite a graph into pipeline stages: submodules stage_0 ... stage_{N-1} called in a chain.

Stage s runs nodes[cuts[s]:cuts[s+1]]. Its inputs are every value made before it and used in
it or later (a skip connection passes through the stages in between, as
torch.distributed.pipelining needs: a stage receives only from the one before); its outputs
are the values used after it. Stage 0 takes the graph's inputs; the last returns what the
graph returns. Attributes (get_attr) are read where they are used, so a parameter two stages
read (a tied embedding and LM head) is the same Parameter in both: shared in one process,
replicated across ranks, as torch.distributed.pipelining does it.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..submodule import stage_module


def crossing(nodes: list[torch.fx.Node], cut: int) -> list[torch.fx.Node]:
    """Values made before position `cut` (attributes aside) and used at or after it, in order."""
    later = set(nodes[cut:])
    return [n for n in nodes[:cut] if n.op != "get_attr" and any(u in later for u in n.users)]


def split_stages(gm: torch.fx.GraphModule, cuts: list[int]) -> torch.fx.GraphModule:
    """A GraphModule whose graph calls stage_0 ... stage_{N-1}, each a GraphModule over the
    original modules and parameters."""
    nodes = list(gm.graph.nodes)
    stages = len(cuts) - 1
    root = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for p in placeholders:
        env[p] = root.node_copy(p)
    owner = torch.nn.Module()  # the stages, registered on the result below
    for s in range(stages):
        inputs = placeholders if s == 0 else crossing(nodes, cuts[s])
        body = [n for n in nodes[cuts[s]:cuts[s + 1]] if n.op not in ("placeholder", "get_attr")]
        final = s == stages - 1
        outputs = None if final else crossing(nodes, cuts[s + 1])
        module = stage_module(gm, inputs, body, outputs, first=s == 0)
        owner.add_module(f"stage_{s}", module)
        call = root.call_module(f"stage_{s}", tuple(env[i] for i in inputs))
        if final:
            results = call
        else:
            for k, value in enumerate(outputs):
                item = root.call_function(operator.getitem, (call, k))
                item.meta = dict(value.meta)
                env[value] = item
    output = nodes[-1]
    # The last stage returns the graph's own result: the output node's structure, unchanged.
    root.output(results, type_expr=output.type)
    root._codegen = gm.graph._codegen  # export graphs flatten inputs and rebuild outputs with pytree specs
    result = torch.fx.GraphModule(owner, root, class_name="Stages")
    result.meta.update(gm.meta)
    for spec in ("_in_spec", "_out_spec"):
        if hasattr(gm, spec):
            setattr(result, spec, getattr(gm, spec))
    return result
