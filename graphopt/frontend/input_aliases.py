"""Inputs that share storage: traced as distinct tensors.

transformers' users call a language model as `model(ids, labels=ids)`: one tensor given twice.
torch.export traces such a call with one placeholder feeding both uses, so on every later batch
the graph would read `labels` where the model reads `input_ids`. Every frontend is therefore
given the example with each tensor that shares storage with an earlier one replaced by a copy
(`distinct`): the graph takes the two as two inputs, as eager does, whatever later calls give.

What the copy changes is a forward that writes into one of its inputs: eager's write shows
through every argument sharing that storage, the graph's does not. Which inputs the model
writes is measured on the traced graph (trace.annotate: the fakes' version counters), and
runtime/input_writes.py refuses an example, and then any call, that gives such an input a
storage another input shares. Python identity tests in forward (`labels is input_ids`) are
traced as false, as for two tensors, which is what the graph then computes on every call.
"""
from __future__ import annotations

import inspect

import torch
import torch.utils._pytree as pytree

from ..analysis.aliases import storage_key


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


def storage_of(t: torch.Tensor):
    """The storage a strided tensor with elements reads (views of one tensor share it); None else."""
    return storage_key(t) if t.layout == torch.strided and t.untyped_storage().nbytes() else None


def distinct(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with every tensor that shares storage with an earlier one replaced by a copy of
    it (same values, strides and requires_grad): what the frontends trace."""
    seen = set()

    def own(t: torch.Tensor) -> torch.Tensor:
        key = storage_of(t)
        if key is None or key not in seen:
            seen.add(key)
            return t
        return t.detach().clone().requires_grad_(t.requires_grad)

    return pytree.tree_map_only(torch.Tensor, own, (args, kwargs))
