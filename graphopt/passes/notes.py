"""A pass's decisions about a node (kept or recomputed, fused group, stage, dtype, ...), kept in
the node's meta for the dumps' node tables."""
from __future__ import annotations

import torch.fx

NOTES = "graphopt"


def note(node: torch.fx.Node, key: str, value) -> None:
    """Record a pass's decision about a node."""
    node.meta.setdefault(NOTES, {})[key] = value


def notes(node: torch.fx.Node) -> dict:
    return node.meta.get(NOTES, {})
