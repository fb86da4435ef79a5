"""One microbatch of train_step's step, as it runs and as its planning predicts it: the backward
of its loss, scaled for how the loss reduces over rows, and the running loss of the batch."""
from __future__ import annotations

import torch

from ..errors import UsageError

REDUCTIONS = ("mean", "sum")


def accumulate(loss, total: torch.Tensor | None, k: int, reduction: str) -> torch.Tensor:
    """Backward of one of k microbatches' loss, scaled for the reduction (1/k for "mean", so that
    the gradients add up to the mean's over the batch); the running loss total."""
    backward(loss, 1.0 / k if reduction == "mean" else 1.0)
    if total is None:  # a copy for k > 1: the total is added into
        return loss.detach() if k == 1 else loss.detach().clone()
    total += loss.detach()
    return total


def backward(loss, scale: float) -> None:
    """loss.backward() scaled, or UsageError where the loss is no scalar floating tensor that
    requires grad."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UsageError(f"the loss is {what}; train_step backpropagates a scalar floating tensor: make "
                         "loss_fn(output, *args, **kwargs) return one (reduce it with .mean() or .sum()).")
    if not loss.requires_grad:
        raise UsageError("the loss does not require grad (no parameter requires grad, or the loss is "
                         "detached): train_step needs a loss computed from the parameters it trains.")
    (loss if scale == 1.0 else loss * scale).backward()
