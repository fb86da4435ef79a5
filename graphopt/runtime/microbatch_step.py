"""One microbatch of a batch run in pieces, as train_step runs it and as its planning predicts it:
the backward of its loss, weighted by its share of the full batch's loss, and the running loss of
the batch; the weights, by how the loss reduces over the batch (analysis/batch_wide.py)."""
from __future__ import annotations

import torch
import torch.fx

from ..errors import UsageError
from ..frontend.graph_inputs import placeholder_values

REDUCTIONS = ("mean", "sum")


def weights(k: int, kind: str, counts: list[int] | None = None) -> list[float]:
    """Each of k microbatches' loss's weight in the full batch's: 1/k for a mean over equal
    microbatches, 1 for a sum, its share of the targets counted for a mean over counted targets
    (a share of none where none is counted: the full batch's mean is then no number either)."""
    if kind == "sum":
        return [1.0] * k
    if kind == "counted mean" and counts is not None and sum(counts) > 0:
        return [c / sum(counts) for c in counts]
    return [1.0 / k] * k


def reduction_of(loss) -> str:
    """How a loss the graph returns (analysis/batch_wide.LossReduction) combines over microbatches:
    as it reduces, a mean where it was not read (None, or unknown)."""
    return "mean" if loss is None or loss.kind == "unknown" else loss.kind


def loss_weights(gm: torch.fx.GraphModule, parts: list[tuple[tuple, dict]], kind: str, loss=None) -> list[float]:
    """weights() for these microbatches of gm's inputs, a mean over counted targets counted by the
    loss's counter (analysis/batch_wide.counted_targets) on each one."""
    counts = None
    if kind == "counted mean" and loss is not None and loss.count is not None and len(parts) > 1:
        counts = [int(loss.count(*placeholder_values(gm, a, k))) for a, k in parts]
    return weights(len(parts), kind, counts)


def accumulate(loss, total: torch.Tensor | None, weight: float) -> torch.Tensor:
    """Backward of one microbatch's loss times its weight (the gradients add up to the full
    batch's); the running loss, the weighted sum of the microbatches' losses."""
    backward(loss, weight)
    part = loss.detach() * weight  # a tensor of its own: the next microbatch's is added into it
    if total is None:
        return part
    total += part
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
