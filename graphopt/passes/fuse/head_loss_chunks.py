"""Rows per chunk of the chunked linear heads and losses (head_loss.py) under a budget: the
recompute pass asks first, as larger chunks run fewer, larger matmuls and a chunk that fits
leaves the rest of the budget to the plan."""
from __future__ import annotations

import math
from typing import Callable

import torch.fx

from ...analysis.meta import tensor_info
from ...runtime.chunked_loss import ChunkedHeadLoss, chunk_rows


def size_chunks(gm: torch.fx.GraphModule, peak_of: Callable[[torch.fx.GraphModule], int], target: int) -> int | None:
    """Set the rows per chunk of every chunked head and loss in gm, the same for all: the largest
    power of two, up to the whole batch, whose step peak_of(gm) puts within target, and at least
    Liger's (chunk_rows: a chunk's logits about the size of the head's input), which stays when
    none fits and recompute has to make room. Returns the rows; None when gm has no such call."""
    heads = [n for n in gm.graph.nodes if isinstance(n.target, ChunkedHeadLoss)]
    if not heads:
        return None
    h, weight = tensor_info(heads[0].args[0]), tensor_info(heads[0].args[1])
    rows = math.prod(h.shape[:-1])
    least = chunk_rows(rows, weight.shape[0], h.shape[-1])
    sizes = [1 << k for k in range(max(rows - 1, 0).bit_length(), -1, -1) if 1 << k >= least] or [least]
    for size in sizes:
        for n in heads:
            n.target = n.target.sized(min(size, rows))
        gm.recompile()
        if size == sizes[-1] or peak_of(gm) <= target:
            return min(size, rows)
