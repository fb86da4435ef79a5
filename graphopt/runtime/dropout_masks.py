"""The dropout masks a fused call draws just before its kernel runs (analysis/dropout_members.py
says how a dropout in training joins a group)."""
from __future__ import annotations

import torch


def draw(shape, p: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The mask eager's dropout draws: its noise in x's dtype (the same draws from the same
    generator; on CPU, bit for bit), kept as bool."""
    return torch.empty(shape, dtype=dtype, device=device).bernoulli_(1 - p).bool()


def with_masks(inputs, draws: tuple, shape, device: torch.device) -> tuple:
    """The inputs with a mask of this shape drawn into each place draws names ((place, p, dtype),
    places ascending: the dropouts' graph order, the order eager draws in)."""
    return tuple(_placed(inputs, draws, lambda p, dtype: draw(shape, p, dtype, device)))


def holes(inputs, draws: tuple) -> list:
    """The inputs with None where the masks go: what a shape rule that skips None reads."""
    return _placed(inputs, draws, lambda p, dtype: None)


def _placed(inputs, draws: tuple, make) -> list:
    placed = list(inputs)
    for place, p, dtype in draws:
        placed.insert(place, make(p, dtype))
    return placed
