"""torch.export with a dynamic batch dimension, so that an exported graph runs at other batch sizes.

Dim 0 of every tensor input with the batch's rows (batch.batch_rows) is one
dimension, "batch", given to export as Dim.AUTO: export keeps it dynamic where the model lets
it, over the range it proves (from 2: it reasons about sizes 0 and 1 apart), and static where
the model's code depends on its value. The range is what the result accepts
(runtime/guards.install_batch_guard). Not Dim("batch", min=1): measured on torch 2.13, export
then traces `if x.shape[0] == 1:` as false with no guard, and the graph is silently wrong at
batch 1. An example batch of one row shows no batch (sizes 0 and 1 are taken as constants):
static, as is a model export cannot make dynamic, each with the reason.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.export import Dim

from .batch import batch_rows

@dataclass(frozen=True)
class BatchRange:
    """The batch sizes an exported graph was proven for (inclusive; None: no upper bound)."""

    low: int
    high: int | None

    def __str__(self) -> str:
        return f"batch {self.low} to {self.high}" if self.high is not None else f"batch {self.low} and up"


def _dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict, dim) -> dict | None:
    """export's dynamic_shapes, by forward()'s parameter names: `dim` on dim 0 of each batched
    tensor, every other dimension and input static."""
    rows = batch_rows(args, kwargs)
    if rows is None:
        return None
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None

    def spec(value):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            return {0: dim}
        return None

    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def export(model: torch.nn.Module, args: tuple, kwargs: dict):
    """(ExportedProgram, BatchRange or None, why static)."""
    rows = batch_rows(args, kwargs)
    shapes = _dynamic_shapes(model, args, kwargs, Dim.AUTO)
    if rows is not None and rows < 2:
        why = "an example batch of one row: export takes sizes 0 and 1 as constants"
    elif shapes is None:
        why = "no tensor input has a batch dimension that forward() names"
    else:
        try:
            ep = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=shapes)
        except Exception as e:  # noqa: BLE001 (export's reason is the note; the static export decides)
            why = f"export with a dynamic batch failed: {_first_line(e)}"
        else:
            found = batch_range(ep)
            if found is not None:
                return ep, found, ""
            why = "export made the batch static: the model's code depends on its size"
    return torch.export.export(model, args, kwargs, strict=False), None, why


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def batch_range(ep) -> BatchRange | None:
    """The batch sizes every batched user input may take: the intersection of the ranges of the
    symbols on their dim 0 (Dim.AUTO gives inputs the model never relates symbols of their
    own; the guard asks them to share one size). None when one of them is static."""
    user_inputs = set(ep.graph_signature.user_inputs)
    low, high, any_symbol = 2, None, False
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or node.name not in user_inputs or not isinstance(val, torch.Tensor) \
                or not val.dim():
            continue
        if not isinstance(val.shape[0], torch.SymInt):
            continue
        bounds = ep.range_constraints.get(val.shape[0].node.expr)
        if bounds is None:
            return None
        any_symbol = True
        low = max(low, int(bounds.lower))
        try:
            upper = int(bounds.upper)
        except (TypeError, ValueError, OverflowError, AttributeError):  # torch's int_oo: no upper bound
            upper = None
        if upper is not None:
            high = upper if high is None else min(high, upper)
    return BatchRange(low, high) if any_symbol else None
