"""The batch of a call: the tensor inputs with a dim 0, which schedules, microbatching and a
dynamic export dimension all take as the rows of one batch (other values are whole)."""
from __future__ import annotations

import torch


def batched(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The top-level tensor inputs of one or more dimensions."""
    return [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim()]


def batch_rows(args: tuple, kwargs: dict) -> int | None:
    """The fewest rows along dim 0 among the batched inputs (None: no input is batched)."""
    return min((v.shape[0] for v in batched(args, kwargs)), default=None)
