"""A model's repeated blocks, read from the nodes' nn_module_stack: the numbered children of its
module tree (`layers.3`, `stages.1.blocks.0`; `layer2`, `denseblock1.denselayer3`, numbered by
name), grouped by level. Recompute's one-line plans checkpoint each block whole; the shard pass
makes each an FSDP unit."""
from __future__ import annotations

import operator
import re
from typing import Callable

import torch.fx

from .segments import SegmentCall

NUMBERED = re.compile(r"[A-Za-z_]+[0-9]+")  # a child numbered by its name: layer2, denselayer3


def module_paths(node: torch.fx.Node) -> list[str]:
    """The module paths a node runs in, outermost first; a recompute segment's call, those its
    nodes run in; one output of a call returning several, the call's."""
    if isinstance(node.target, SegmentCall):
        return list(dict.fromkeys(path for n in node.target.module.graph.nodes if n.op.startswith("call")
                                  for path in module_paths(n)))
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and node.args[0].op != "placeholder":
        # an output of a call that returns several: where the call runs (a fused group whose outputs
        # lie in two blocks, a residual add and the next block's norm, runs in neither)
        return module_paths(node.args[0])
    return [entry[0] if isinstance(entry, tuple) else str(entry)
            for entry in (node.meta.get("nn_module_stack") or {}).values()]


def block_levels(nodes: list[torch.fx.Node], take: Callable[[int], bool] = lambda i: True) -> dict[object, dict[str, list[int]]]:
    """For each level of numbered children (by how many numbered parts its paths have, indexes and
    names apart), each block's path -> the positions of the nodes it runs (those `take` accepts)."""
    levels: dict[object, dict[str, list[int]]] = {}
    for i, n in enumerate(nodes):
        if not n.op.startswith("call") or not take(i):
            continue
        for path in module_paths(n):
            parts = path.split(".")
            if parts[-1].isdigit():
                levels.setdefault(sum(p.isdigit() for p in parts), {}).setdefault(path, []).append(i)
            elif NUMBERED.fullmatch(parts[-1]):  # timm's ResNet stages layer1..layer4, DenseNet's denselayer1..
                levels.setdefault(("named", sum(bool(NUMBERED.fullmatch(p)) for p in parts)), {}).setdefault(path, []).append(i)
    return levels


def outer_blocks(nodes: list[torch.fx.Node]) -> dict[str, list[int]]:
    """The outermost level with two or more blocks (numbered by index before by name): a
    transformer's layers, a ResNet's stages. Empty where the model repeats none."""
    levels = {key: blocks for key, blocks in block_levels(nodes).items() if len(blocks) >= 2}
    if not levels:
        return {}
    key = min(levels, key=lambda k: (isinstance(k, tuple), k[1] if isinstance(k, tuple) else k))
    return levels[key]
