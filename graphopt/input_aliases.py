"""Inputs that share storage: traced as distinct tensors, and refused where the model writes one.

transformers' users call a language model as `model(ids, labels=ids)`: one tensor given twice.
torch.export traces such a call with one placeholder feeding both uses, so on every later batch
the graph would read `labels` where the model reads `input_ids`. Every frontend is therefore
given the example with each tensor that shares storage with an earlier one replaced by a copy
(`distinct`): the graph takes the two as two inputs, as eager does, whatever later calls give.

What the copy changes is a forward that writes into one of its inputs: eager's write shows
through every argument sharing that storage, the graph's does not. Which inputs the model
writes is measured on the traced graph (trace.annotate: the fakes' version counters), and
`WriteAliasCheck` refuses an example, and then any call, that gives such an input a storage
another input shares. Python identity tests in forward (`labels is input_ids`) are traced as
false, as for two tensors, which is what the graph then computes on every call.
"""
from __future__ import annotations

import inspect

import torch
import torch.fx
import torch.utils._pytree as pytree

from .analysis.aliases import storage_key
from .errors import UsageError


def input_names(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor leaf of a call, named after forward()'s parameters
    ('labels', 'pixel_values[1]'), or by position where the signature cannot bind them."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}
    named = []
    for name, value in bound.items():
        leaves, _ = pytree.tree_flatten_with_path(value)
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                named.append((name + pytree.keystr(path), leaf))
    return named


def _key(t: torch.Tensor):
    return storage_key(t) if t.layout == torch.strided and t.untyped_storage().nbytes() else None


def distinct(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with every tensor that shares storage with an earlier one replaced by a copy of
    it (same values, strides and requires_grad): what the frontends trace."""
    seen = set()

    def own(t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key is None or key not in seen:
            seen.add(key)
            return t
        return t.detach().clone().requires_grad_(t.requires_grad)

    return pytree.tree_map_only(torch.Tensor, own, (args, kwargs))


class WriteAliasCheck:
    """A forward pre-hook (with kwargs): a call that gives an input the graph writes a storage
    another input shares raises UsageError, as eager's write would show through the other."""

    def __init__(self, model: torch.nn.Module, gm: torch.fx.GraphModule, written: list[str]):
        self.model, self.written = model, set(written)
        self.order = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

    def check(self, gm: torch.fx.GraphModule, args: tuple, kwargs: dict, when: str) -> None:
        from .trace import placeholder_values

        values = dict(zip(self.order, placeholder_values(gm, args, kwargs)))
        written = {_key(t) for name, t in values.items() if name in self.written and isinstance(t, torch.Tensor)}
        names = input_names(self.model, args, kwargs)
        for key in written - {None}:
            sharing = [name for name, t in names if _key(t) == key]
            if len(sharing) > 1:
                raise UsageError(
                    f"{type(self.model).__name__}.forward writes in place into its input {sharing[0]!r} or "
                    f"{sharing[1]!r}, and {when} gives both one storage: eager's write shows through both, a graph's "
                    f"through one only. Give each of them a tensor of its own (e.g. {sharing[1]}=x.clone()).")

    def __call__(self, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
        self.check(gm, args, kwargs, "this call")
