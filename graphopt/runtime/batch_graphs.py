"""Graphs for other batch sizes, where an optimized graph takes its example's batch only.

torch.export makes a batch static where the model's code depends on its size (CLIP's
contrastive loss takes `len(logits)` for its targets), and a pass may specialize a graph to the
example's shapes. A loader without drop_last ends every epoch on a smaller batch, which such a
graph refuses. So the graph optimize(model, example_inputs) returns, called with another batch
size and otherwise sizes it takes, builds a graph for that call as the lazy form builds one (the
same pipeline and options: under a budget, a recompute plan made for that batch, or the budget's
error where none fits it), keeps it and runs it; at most lazy.MAX_GRAPHS are kept, the least
recently used dropped first. The route starts from the guards' refusal (guards.sizes_refused,
raised before anything runs), so a call the graph takes pays nothing for it; a call whose
signature was routed before goes straight to its graph.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import BudgetError, GraphoptError, UsageError
from ..frontend.batch import batch_rows
from .guards import call_key

MAX_ROUTES = 1024  # call signatures remembered, all forgotten past it (each a handful of shapes)


class BatchGraphs:
    """The graphs built by `build(args, kwargs, training, dump_dir=...)` for other batch sizes
    than the example's (args, kwargs); sizes: the export sizes the graph takes (None: the
    example's alone, or any where the graph is fx's)."""

    def __init__(self, build: Callable, example: tuple[tuple, dict], sizes, dump_dir: str | None, limit: int):
        self.build, self.sizes, self.dump_dir, self.limit = build, sizes, dump_dir, limit
        self.example = pytree.tree_leaves(example)
        self.rows = batch_rows(*example)
        self.graphs: OrderedDict[int, torch.fx.GraphModule] = OrderedDict()  # by batch rows
        self.routes: dict = {}  # call_key -> the rows of the graph that ran it

    def graph_for(self, refused: UsageError, training: bool, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
        """The graph for this call's batch, built where none is kept; `refused` raised again
        where the call differs from the example in more than the batch the graph could take."""
        rows = batch_rows(args, kwargs)
        if rows is None or rows == self.rows or not self._batch_alone(pytree.tree_leaves((args, kwargs)), rows):
            raise refused
        graph = self.graphs.pop(rows, None)
        if graph is None:
            dump_dir = os.path.join(self.dump_dir, f"batch-{rows}") if self.dump_dir else None
            try:
                graph = self.build(args, kwargs, training, dump_dir=dump_dir)
            except GraphoptError as e:
                why = (f"this graphopt module was built for a batch of {self.rows} rows, and one of {rows} needs a "
                       f"graph of its own, which could not be built: {e}")
                raise (BudgetError(why) if isinstance(e, BudgetError) else UsageError(why)) from e
        self.graphs[rows] = graph
        while len(self.graphs) > self.limit:
            dropped, _ = self.graphs.popitem(last=False)
            self.routes = {k: r for k, r in self.routes.items() if r != dropped}
        key = call_key(args, kwargs)
        if key is not None:
            if len(self.routes) >= MAX_ROUTES:
                self.routes.clear()
            self.routes[key] = rows
        return graph

    def routed(self, args: tuple, kwargs: dict) -> torch.fx.GraphModule | None:
        """The graph a call of a signature routed before runs on, now the most recently used."""
        rows = self.routes.get(call_key(args, kwargs))
        if rows is None:
            return None
        self.graphs.move_to_end(rows)
        return self.graphs[rows]

    def _batch_alone(self, call: list, rows: int) -> bool:
        """Whether the call's tensors are the example's but for the batch (dim 0 of those with
        the example's rows) and sizes the graph takes dynamically."""
        if len(call) != len(self.example):
            return False
        names = self.sizes.names if self.sizes is not None else [None] * len(call)
        for was, got, dynamic in zip(self.example, call, names):
            if isinstance(was, torch.Tensor) != isinstance(got, torch.Tensor):
                return False
            if not isinstance(was, torch.Tensor):
                continue
            if was.dim() != got.dim() or was.dtype != got.dtype:
                return False
            for d, (a, b) in enumerate(zip(was.shape, got.shape)):
                batch = d == 0 and a == self.rows and b == rows
                if a != b and not batch and not (dynamic is not None and dynamic[d] is not None):
                    return False
        return True


def install_batch_graphs(gm: torch.fx.GraphModule, build: Callable, example: tuple[tuple, dict],
                         dump_dir: str | None, limit: int) -> BatchGraphs:
    """Route gm's calls at another batch size, which its guards refuse, to graphs built for them.
    gm's class is its own (fx makes one per instance): the route touches no other module."""
    graphs = BatchGraphs(build, example, gm.meta.get("graphopt_sizes"), dump_dir, limit)
    call = type(gm).__call__

    def __call__(self, *args, **kwargs):
        if graphs.routes:
            other = graphs.routed(args, kwargs)
            if other is not None:
                return other(*args, **kwargs)
        try:
            return call(self, *args, **kwargs)
        except UsageError as refused:
            if not getattr(refused, "sizes_refused", False):
                raise
            other = graphs.graph_for(refused, self.training, args, kwargs)
        return other(*args, **kwargs)

    type(gm).__call__ = __call__
    gm.graphopt_batch_graphs = graphs
    return graphs
