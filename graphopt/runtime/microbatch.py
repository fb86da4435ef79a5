"""How pipeline schedules cut a batch: every tensor input of one or more dimensions along dim 0
(as torch.distributed.pipelining splits it), other values whole."""
from __future__ import annotations

import torch

from ..errors import UsageError
from ..frontend.batch import differing_rows, rows_differ

__all__ = ["first_microbatch", "split_batch"]


def first_microbatch(args: tuple, kwargs: dict, microbatches: int) -> tuple[tuple, dict]:
    """The first of `microbatches` parts of a batch, split as torch.distributed.pipelining
    splits it: every tensor of one or more dimensions along dim 0 (tensor_split), other
    values whole."""
    sizes = differing_rows(args, kwargs)
    if sizes is not None:  # one of them is not a batch: splitting it would pair the wrong rows
        raise UsageError(f"{rows_differ(sizes)}.")

    def first(v):
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return v
        if v.shape[0] < microbatches:
            raise UsageError(f"an example input has {v.shape[0]} rows along dim 0, fewer than the "
                             f"{microbatches} microbatches it is split into: give a larger example batch "
                             "or fewer microbatches.")
        return v.tensor_split(microbatches)[0]

    return tuple(first(a) for a in args), {k: first(v) for k, v in kwargs.items()}


def split_batch(args: tuple, kwargs: dict, k: int) -> list[tuple[tuple, dict]]:
    """The k microbatches of a batch, split as first_microbatch splits it (tensor_split along
    dim 0 of every tensor with one or more dimensions; other values whole in each)."""
    first_microbatch(args, kwargs, k)  # the same checks: one batch size, at least k rows

    def part(v, i):
        return v.tensor_split(k)[i] if isinstance(v, torch.Tensor) and v.dim() else v

    return [(tuple(part(a, i) for a in args), {name: part(v, i) for name, v in kwargs.items()}) for i in range(k)]
