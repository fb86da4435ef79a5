"""A staged graph called in one process with the batch it was optimized for: the batch runs as
the microbatches PipelineRunner's schedules would cut it into, one after another, and their
outputs merge into the output of the whole batch.

Merging, leaf by leaf of the output's pytree: a tensor with its microbatch's rows along dim 0
is concatenated (torch.distributed.pipelining merges outputs so); a 0-d floating tensor (a
loss) is the microbatches' losses weighted as the loss reduces over the batch
(microbatch_step.weights: a mean's by 1/k, a sum's by 1, a mean over counted targets by each
microbatch's share of them), so its backward leaves the full batch's gradients, as train_step's
microbatches do; any other leaf must be equal in every microbatch, or the call raises: there is
no right way to merge it.
"""
from __future__ import annotations

import functools

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import UsageError
from ..frontend.batch import batch_rows
from ..frontend.graph_inputs import register_dataclasses
from .microbatch import split_batch
from .microbatch_step import loss_weights, reduction_of


def install_microbatch_split(gm: torch.fx.GraphModule, full_rows: int, microbatches: int, loss=None) -> None:
    """Calls of gm with full_rows rows run as `microbatches` microbatches; others run as given.
    loss: the graph's scalar loss (analysis/batch_wide.LossReduction), None for a mean. fx makes a
    class per GraphModule, so replacing its forward touches no other module."""
    plain = type(gm).forward

    @functools.wraps(plain)  # the signature stays the graph's: placeholder_values binds calls by it
    def forward(self, *args, **kwargs):
        if batch_rows(args, kwargs) != full_rows:
            return plain(self, *args, **kwargs)
        parts = split_batch(args, kwargs, microbatches)
        shares = loss_weights(self, parts, reduction_of(loss), loss)
        return merge_outputs([plain(self, *a, **k) for a, k in parts], [batch_rows(a, k) for a, k in parts], shares)

    type(gm).forward = forward


def merge_outputs(outputs: list, rows: list[int], shares: list[float] | None = None):
    """One output from the microbatches' outputs, rows[i] the rows of microbatch i, shares[i] its
    loss's weight (default: a mean's) (the rules in the module's docstring)."""
    shares = shares or [1.0 / len(outputs)] * len(outputs)
    register_dataclasses(outputs[0])  # a model's output dataclass flattens like export's
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    if any(s != spec for _, s in flat[1:]):
        raise UsageError("the microbatches returned outputs of different structures, which do not merge into "
                         "one: call the staged graph on one microbatch at a time, or through PipelineRunner.")
    merged = []
    for k, leaves in enumerate(zip(*(leaves for leaves, _ in flat))):
        merged.append(_merge_leaf(k, list(leaves), rows, shares))
    return pytree.tree_unflatten(merged, spec)


def _merge_leaf(k: int, parts: list, rows: list[int], shares: list[float]):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if all(isinstance(p, torch.Tensor) and p.dim() and p.shape[0] == r for p, r in zip(parts, rows)):
            return torch.cat(parts, dim=0)
        if first.dim() == 0 and first.is_floating_point():
            return sum(p * w for p, w in zip(parts, shares))
        if all(torch.equal(p, first) for p in parts):
            return first
    elif all(p == first for p in parts):
        return first
    raise UsageError(f"output leaf {k} differs between microbatches and is neither a batch nor a scalar loss, so "
                     "it has no merge: call the staged graph on one microbatch at a time, or through PipelineRunner.")
