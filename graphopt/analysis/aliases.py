"""Which nodes' tensors share storage (an analysis), read off the FakeTensor annotation.

annotate() leaves each node's FakeTensor in node.meta["val"]. Fakes of one run share a storage
exactly where the real tensors would: a view, an in-place op's result, an op that returns its
input, whatever the op and however opaque. After a rewrite the classes may be stale only in
the safe direction: a node made out of place no longer aliases what it did (re-annotating
makes them exact again).
"""
from __future__ import annotations

import torch
import torch.fx
import torch.utils._pytree as pytree

from .meta import is_annotated


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind t (views of one tensor share it)."""
    return t.untyped_storage()._cdata


class Aliases:
    def __init__(self, gm: torch.fx.GraphModule):
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.storages: dict[torch.fx.Node, set[int]] = {}
        self.members: dict[int, list[torch.fx.Node]] = {}
        # the last FakeTensor run reached every node (a node that returns None has no value)
        self.complete = all(is_annotated(n) for n in gm.graph.nodes)
        for node in gm.graph.nodes:
            keys = {storage_key(t) for t in pytree.tree_leaves(node.meta.get("val"))
                    if isinstance(t, torch.Tensor) and t.layout == torch.strided}
            self.storages[node] = keys
            for key in keys:
                self.members.setdefault(key, []).append(node)

    def sharing(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """The nodes whose tensors share a storage with node's (node included)."""
        return list(dict.fromkeys(m for key in self.storages.get(node, ()) for m in self.members[key]))

    def sole_storage(self, node: torch.fx.Node) -> int | None:
        keys = self.storages.get(node, set())
        return next(iter(keys)) if len(keys) == 1 else None

    def why_not_private(self, x: torch.fx.Node, at: torch.fx.Node) -> str | None:
        """Why a write into x's storage at node `at` could be seen other than through x and `at`'s
        result (None when it cannot): x must be one tensor the graph made, not an input,
        parameter or buffer nor a view of one, and every other tensor sharing its storage must be
        made after `at` or be dead by then."""
        if not self.complete:
            return "the graph is not annotated"
        key = self.sole_storage(x)
        if key is None:
            return f"{x.name} is not one tensor"
        for m in self.members[key]:
            if m in (x, at):
                continue
            if m.op in ("placeholder", "get_attr"):
                return f"{x.name} shares storage with the input or state {m.name}"
            if self.order[m] < self.order[at] and any(self.order[u] >= self.order[at] for u in m.users):
                return f"{m.name} shares {x.name}'s storage and is used later"
        if x.op in ("placeholder", "get_attr"):
            return f"{x.name} is an input, parameter or buffer"
        return None
