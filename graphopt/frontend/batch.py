"""The batch of a call: the tensor inputs with a dim 0, which schedules, microbatching and a
dynamic export dimension all take as the rows of one batch (other values are whole); and the
rules of splitting it into microbatches, the same for pipeline schedules and train_step."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree


def batched(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The top-level tensor inputs of one or more dimensions."""
    return [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim()]


def batch_rows(args: tuple, kwargs: dict) -> int | None:
    """The fewest rows along dim 0 among the batched inputs (None: no input is batched)."""
    return min((v.shape[0] for v in batched(args, kwargs)), default=None)


def differing_rows(args: tuple, kwargs: dict) -> list[int] | None:
    """The batched inputs' row counts where they differ (a split cutting every one of them would
    pair the wrong rows); None where they agree."""
    sizes = sorted({int(t.shape[0]) for t in batched(args, kwargs)})
    return sizes if len(sizes) > 1 else None


def splits_evenly(args: tuple, kwargs: dict, microbatches: int) -> bool:
    return all(v.shape[0] % microbatches == 0 for v in batched(args, kwargs))


def why_unsplittable(args: tuple, kwargs: dict) -> str | None:
    """Why the batch cannot be cut into microbatches, or None."""
    if any(isinstance(t, torch.Tensor) for v in (*args, *kwargs.values()) if not isinstance(v, torch.Tensor)
           for t in pytree.tree_leaves(v)):
        return ("a tensor inside a container argument (a list, a dict) would reach every microbatch whole; "
                "pass the batch's tensors as arguments of their own")
    if not batched(args, kwargs):
        return "no tensor argument has a batch dimension"
    sizes = differing_rows(args, kwargs)
    return None if sizes is None else rows_differ(sizes)


def rows_differ(sizes: list[int]) -> str:
    """Why a batch whose tensor arguments have these different row counts does not split."""
    return (f"the tensor arguments differ in rows along dim 0 ({sizes}), and a split cuts every one of them "
            "(as torch.distributed.pipelining splits a batch): make those that are not batches buffers of the "
            "model, or give them a batch dimension")


def microbatch_counts(args: tuple, kwargs: dict) -> list[int]:
    """The microbatch counts that split the batch into equal parts (1 alone when it does not split)."""
    if why_unsplittable(args, kwargs):
        return [1]
    return [k for k in range(1, batch_rows(args, kwargs) + 1) if splits_evenly(args, kwargs, k)]
