"""The masks a fused call draws just before its kernel runs (passes/fuse/dropout_members.py says how
a dropout in training, or a stochastic depth's bernoulli, joins a group)."""
from __future__ import annotations

import torch


def draw(noise: torch.Tensor, keep: float) -> torch.Tensor:
    """The mask eager draws into its noise, noise.bernoulli_(keep) (the same draws from the same
    generator; on CPU, bit for bit), kept as bool."""
    return noise.bernoulli_(keep).bool()


def with_masks(inputs, draws: tuple, shape, device: torch.device) -> tuple:
    """The call's inputs with its masks in their places. draws, places ascending (graph order, the
    order eager draws in): (place, keep, dtype, sourced). A sourced mask is drawn at the shape of
    the input given at its place, which it replaces (a bernoulli's input); any other one is
    inserted there, drawn at `shape` (a dropout's: the group's)."""
    # ATen's functional bernoulli draws into empty_like(its input), dropout into empty_like(x)
    return tuple(_placed(inputs, draws, lambda given, keep, dtype: draw(
        torch.empty(shape, dtype=dtype, device=device) if given is None else torch.empty_like(given), keep)))


def with_stand_ins(inputs, draws: tuple, shape, device: torch.device) -> tuple:
    """The call's inputs with uninitialized masks of the drawn ones' shapes and dtype in their
    places: what binding a call needs to know of them, nothing drawn."""
    return tuple(_placed(inputs, draws, lambda given, keep, dtype: torch.empty(
        shape if given is None else given.shape, dtype=torch.bool, device=device)))


def holes(inputs, draws: tuple) -> list:
    """The inputs with None where the masks go: what a shape rule that skips None reads."""
    return _placed(inputs, draws, lambda given, keep, dtype: None)


def inserted(draws: tuple) -> int:
    """How many of the call's inputs the graph does not give: its dropouts' masks."""
    return sum(not sourced for *_, sourced in draws)


def _placed(inputs, draws: tuple, make) -> list:
    placed = list(inputs)
    for place, keep, dtype, sourced in draws:
        if sourced:
            placed[place] = make(placed[place], keep, dtype)
        else:
            placed.insert(place, make(None, keep, dtype))
    return placed
