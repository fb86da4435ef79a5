"""Graphs for other batch sizes, where an optimized graph takes its example's batch only.

torch.export makes a batch static where the model's code depends on its size (CLIP's
contrastive loss takes `len(logits)` for its targets), and a pass may specialize a graph to the
example's shapes. A loader without drop_last ends every epoch on a smaller batch, which such a
graph refuses. So the graph optimize(model, example_inputs) returns, called at another batch
size than its guards take, builds a graph for that call as the lazy form builds one (the same
pipeline and options: under a budget, a recompute plan made for that batch, or the budget's
error where none fits it), keeps it and runs it; at most lazy.MAX_GRAPHS are kept, the least
recently used dropped first. The route starts from the guards' refusal (SizesRefused, raised
before anything runs), so a call the graph takes pays nothing for it.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable

import torch
import torch.fx

from ..batch import batch_rows
from ..errors import BudgetError, GraphoptError, UsageError
from .guards import SizesRefused


class BatchGraphs:
    """The graphs built for other batch sizes than `rows`, the example's, by `build(args, kwargs,
    dump_dir=...)`, newest last."""

    def __init__(self, build: Callable, rows: int, dump_dir: str | None, limit: int):
        self.build, self.rows, self.dump_dir, self.limit = build, rows, dump_dir, limit
        self.graphs: OrderedDict[int, torch.fx.GraphModule] = OrderedDict()

    def graph_for(self, refused: SizesRefused, training: bool, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
        """The graph for this call's batch, built where none is kept; `refused` raised again
        where the batch is the example's (another size was refused)."""
        rows = batch_rows(args, kwargs)
        if rows is None or rows == self.rows:
            raise refused
        graph = self.graphs.pop(rows, None)
        if graph is None:
            dump_dir = os.path.join(self.dump_dir, f"batch-{rows}") if self.dump_dir else None
            try:
                graph = self.build(args, kwargs or None, training, dump_dir=dump_dir)
            except GraphoptError as e:
                why = (f"this graphopt module was built for a batch of {self.rows} rows, and one of {rows} needs a "
                       f"graph of its own, which could not be built: {e}")
                raise (BudgetError(why) if isinstance(e, BudgetError) else UsageError(why)) from e
        self.graphs[rows] = graph
        while len(self.graphs) > self.limit:
            self.graphs.popitem(last=False)
        return graph


def install_batch_graphs(gm: torch.fx.GraphModule, build: Callable, rows: int, dump_dir: str | None,
                         limit: int) -> BatchGraphs:
    """Route gm's calls at another batch size, which its guards refuse, to graphs built for them.
    gm's class is its own (fx makes one per instance): the route touches no other module."""
    graphs = BatchGraphs(build, rows, dump_dir, limit)
    call = type(gm).__call__

    def __call__(self, *args, **kwargs):
        try:
            return call(self, *args, **kwargs)
        except SizesRefused as refused:
            other = graphs.graph_for(refused, self.training, args, kwargs)
        return other(*args, **kwargs)

    type(gm).__call__ = __call__
    gm.graphopt_batch_graphs = graphs
    return graphs
