"""A second batch for verify=True: the example's shapes and dtypes, values drawn apart from it.

A graph built from one example must equal eager on every batch of its signature; a graph that
depends on its example's values (two inputs traced as one, a branch export took for an all-ones
mask) equals eager on the example only. Each tensor of the call is drawn on its own, so inputs
the example gives as one tensor (`labels=input_ids`) come apart:
  - floating: normal values with the example tensor's mean and standard deviation;
  - integer: uniform over the range of the example's non-negative values (token ids stay in the
    vocabulary the example shows, an all-ones mask stays all ones); where the example has
    negative values (the -100 of ignored labels), as many positions again, drawn at random,
    take them;
  - boolean: True with the example's share.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree


def draw_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A tensor of t's shape, dtype and device (and requires_grad) with values drawn as above."""
    x = t.detach().cpu()
    if x.dtype == torch.bool:
        share = x.float().mean() if x.numel() else torch.tensor(0.0)
        drawn = torch.rand(x.shape, generator=gen) < share
    elif x.dtype.is_floating_point or x.dtype.is_complex:
        wide = x.double()
        mean, std = (wide.mean(), wide.std()) if x.numel() > 1 else (wide.sum(), torch.tensor(0.0, dtype=torch.double))
        drawn = (torch.randn(x.shape, generator=gen, dtype=torch.double) * std.nan_to_num(0.0)
                 + mean.nan_to_num(0.0)).to(x.dtype)
    else:
        drawn = _integers(x, gen)
    return drawn.to(t.device).requires_grad_(t.requires_grad)


def _integers(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if not x.numel():
        return x.clone()
    valid, sentinels = x[x >= 0], x[x < 0]
    if not valid.numel():
        return x.clone()
    low, high = int(valid.min()), int(valid.max())
    drawn = torch.randint(low, high + 1, x.shape, generator=gen, dtype=x.dtype)
    if sentinels.numel():
        where = torch.rand(x.shape, generator=gen) < sentinels.numel() / x.numel()
        pick = sentinels[torch.randint(0, sentinels.numel(), x.shape, generator=gen)]
        drawn = torch.where(where, pick, drawn)
    return drawn


def second_batch(args: tuple, kwargs: dict, seed: int = 1) -> tuple[tuple, dict]:
    """(args, kwargs) of the example's structure, every tensor drawn apart (draw_like)."""
    gen = torch.Generator().manual_seed(seed)
    return pytree.tree_map_only(torch.Tensor, lambda t: draw_like(t, gen), (args, kwargs))
