"""Which of a fused group's nodes its kernel stores, and which it hands on without storing."""
from __future__ import annotations

import torch.fx

from ...analysis.effects import kind_check


def outside_users(node: torch.fx.Node, inside: set) -> list[torch.fx.Node]:
    """The node's users outside the group, but the checks of its dtype or device alone
    (effects.kind_check): the group settles those, its call checking its inputs' dtypes and devices
    where it binds, and the fuse pass drops them with the group's nodes."""
    return [u for u in node.users if u not in inside and not kind_check(u, None)]


def absorbed_checks(nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The checks of the group's values that the group settles (outside_users leaves them out)."""
    inside = set(nodes)
    return [u for n in nodes for u in n.users if u not in inside and kind_check(u, None)]


def group_outputs(nodes: list[torch.fx.Node], refs: dict, inputs: list, computed=lambda node: True):
    """(outputs, stored, aliases) for a group's nodes, given each computed node's ref in the group
    (("input", k) or ("step", j)): a node used outside the group is an output, stored from its step,
    unless it is one of the group's inputs itself (an identity of an input) or a step already
    stored (an identity of a value stored): then an alias of that input or output, the same
    tensor, as in eager."""
    inside = set(nodes)
    outputs, stored, aliases = [], [], {}
    for node in nodes:
        if not computed(node) or not outside_users(node, inside):
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
