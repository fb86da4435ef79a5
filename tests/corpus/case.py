"""One corpus model with its example inputs and the loss its users train it with."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree


@dataclass
class Case:
    model: torch.nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)
    # output -> scalar loss; the model's own (HF `.loss` with labels) or cross-entropy on targets
    loss: Callable = None

    def __post_init__(self):
        if self.loss is None:
            self.loss = own_loss

    def repeated(self, k: int) -> "Case":
        """The same model on k copies of the batch (targets too): activations k times larger."""
        def grow(t):
            return t.repeat(k, *[1] * (t.dim() - 1)) if t.dim() else t
        args, kwargs = pytree.tree_map_only(torch.Tensor, grow, (self.args, self.kwargs))
        loss = self.loss.repeated(k) if hasattr(self.loss, "repeated") else self.loss
        return Case(self.model, args, kwargs, loss)

    def with_rows(self, n: int) -> "Case":
        """The same model on a batch of n rows: the batch repeated as needed, then its first n."""
        rows = min(t.shape[0] for t in pytree.tree_leaves((self.args, self.kwargs))
                   if isinstance(t, torch.Tensor) and t.dim())
        grown = self.repeated(-(-n // rows))

        def first(t):
            return t[:n] if t.dim() and t.shape[0] == rows * -(-n // rows) else t
        args, kwargs = pytree.tree_map_only(torch.Tensor, first, (grown.args, grown.kwargs))
        loss = grown.loss.first(n) if hasattr(grown.loss, "first") else grown.loss
        return Case(self.model, args, kwargs, loss)


def own_loss(out) -> torch.Tensor:
    """The loss a model with labels computes itself (transformers' ModelOutput.loss)."""
    return out["loss"] if isinstance(out, dict) else out.loss


@dataclass
class cross_entropy:  # noqa: N801 (used as a function: the loss of a Case)
    """Cross-entropy of a classifier's logits against fixed targets."""

    targets: torch.Tensor

    def __call__(self, out) -> torch.Tensor:
        logits = out if isinstance(out, torch.Tensor) else out[0]
        return F.cross_entropy(logits.float(), self.targets)

    def repeated(self, k: int) -> "cross_entropy":
        return cross_entropy(self.targets.repeat(k))

    def first(self, n: int) -> "cross_entropy":
        return cross_entropy(self.targets[:n])


def images(batch: int = 2, size: int = 64, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,))


def image_case(model: torch.nn.Module, batch: int = 2, size: int = 64, classes: int = 10) -> Case:
    x, y = images(batch, size, classes)
    return Case(model, (x,), {}, cross_entropy(y))
