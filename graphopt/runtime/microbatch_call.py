"""A staged graph called in one process with the batch it was optimized for: the batch runs as
the microbatches PipelineRunner's schedules would cut it into, one after another, and their
outputs merge into the output of the whole batch.

Merging, leaf by leaf of the output's pytree: a tensor with its microbatch's rows along dim 0
is concatenated (torch.distributed.pipelining merges outputs so); a 0-d floating tensor (a
loss) is the mean over the microbatches, so its backward leaves the gradients the schedules
leave, those of the mean microbatch loss (the full batch's, for a mean-reduced loss over equal
microbatches); any other leaf must be equal in every microbatch, or the call raises: there is no
right way to merge it.
"""
from __future__ import annotations

import functools

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..batch import batch_rows
from ..errors import UsageError
from ..trace import register_dataclasses
from .microbatch import split_batch


def install_microbatch_split(gm: torch.fx.GraphModule, full_rows: int, microbatches: int) -> None:
    """Calls of gm with full_rows rows run as `microbatches` microbatches; others run as given.
    fx makes a class per GraphModule, so replacing its forward touches no other module."""
    plain = type(gm).forward

    @functools.wraps(plain)  # the signature stays the graph's: placeholder_values binds calls by it
    def forward(self, *args, **kwargs):
        if batch_rows(args, kwargs) != full_rows:
            return plain(self, *args, **kwargs)
        parts = split_batch(args, kwargs, microbatches)
        return merge_outputs([plain(self, *a, **k) for a, k in parts], [batch_rows(a, k) for a, k in parts])

    type(gm).forward = forward


def merge_outputs(outputs: list, rows: list[int]):
    """One output from the microbatches' outputs, rows[i] the rows of microbatch i (the rules
    in the module's docstring)."""
    register_dataclasses(outputs[0])  # a model's output dataclass flattens like export's
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    if any(s != spec for _, s in flat[1:]):
        raise UsageError("the microbatches returned outputs of different structures, which do not merge into "
                         "one: call the staged graph on one microbatch at a time, or through PipelineRunner.")
    merged = []
    for k, leaves in enumerate(zip(*(leaves for leaves, _ in flat))):
        merged.append(_merge_leaf(k, list(leaves), rows))
    return pytree.tree_unflatten(merged, spec)


def _merge_leaf(k: int, parts: list, rows: list[int]):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if all(isinstance(p, torch.Tensor) and p.dim() and p.shape[0] == r for p, r in zip(parts, rows)):
            return torch.cat(parts, dim=0)
        if first.dim() == 0 and first.is_floating_point():
            return torch.stack(parts).mean()
        if all(torch.equal(p, first) for p in parts):
            return first
    elif all(p == first for p in parts):
        return first
    raise UsageError(f"output leaf {k} differs between microbatches and is neither a batch nor a scalar loss, so "
                     "it has no merge: call the staged graph on one microbatch at a time, or through PipelineRunner.")
