"""Which of a fused group's nodes its kernel stores, and which it hands on without storing."""
from __future__ import annotations

import torch.fx


def group_outputs(nodes: list[torch.fx.Node], refs: dict, inputs: list, computed=lambda node: True):
    """(outputs, stored, aliases) for a group's nodes, given each computed node's ref in the group
    (("input", k) or ("step", j)): a node used outside the group is an output, stored from its step,
    unless it is one of the group's inputs itself (an identity of an input) or a step already
    stored (an identity of a value stored): then an alias of that input or output, the same
    tensor, as in eager."""
    inside = set(nodes)
    outputs, stored, aliases = [], [], {}
    for node in nodes:
        if not computed(node) or not any(user not in inside for user in node.users):
            continue
        kind, index = refs[node]
        if kind == "input":
            aliases[node] = inputs[index]
        elif index not in stored:
            stored.append(index)
            outputs.append(node)
        else:
            aliases[node] = outputs[stored.index(index)]
    return outputs, stored, aliases
