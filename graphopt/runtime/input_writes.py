"""The check that keeps inputs traced as distinct (input_aliases.py) right when a call gives two
arguments one storage: a model that writes in place into one of its inputs (measured on the traced
graph, trace.annotate) would show the write through the other in eager, not in the graph."""
from __future__ import annotations

import torch
import torch.fx

from ..errors import UsageError
from ..frontend.graph_inputs import placeholder_values
from ..frontend.input_aliases import input_names, storage_of


class WriteAliasCheck:
    """A forward pre-hook (with kwargs): a call that gives an input the graph writes a storage
    another input shares raises UsageError, as eager's write would show through the other."""

    def __init__(self, model: torch.nn.Module, gm: torch.fx.GraphModule, written: list[str]):
        self.model, self.written = model, set(written)
        self.order = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

    def check(self, gm: torch.fx.GraphModule, args: tuple, kwargs: dict, when: str) -> None:
        values = dict(zip(self.order, placeholder_values(gm, args, kwargs)))
        written = {storage_of(t) for name, t in values.items() if name in self.written and isinstance(t, torch.Tensor)}
        names = input_names(self.model, args, kwargs)
        for key in written - {None}:
            sharing = [name for name, t in names if storage_of(t) == key]
            if len(sharing) > 1:
                raise UsageError(
                    f"{type(self.model).__name__}.forward writes in place into its input {sharing[0]!r} or "
                    f"{sharing[1]!r}, and {when} gives both one storage: eager's write shows through both, a graph's "
                    f"through one only. Give each of them a tensor of its own (e.g. {sharing[1]}=x.clone()).")

    def __call__(self, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
        self.check(gm, args, kwargs, "this call")
