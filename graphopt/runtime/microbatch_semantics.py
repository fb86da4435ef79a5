"""What running a batch in pieces does to a model's result, said once for every path that does it:
train_step's microbatches and a staged graph called with the full batch (which runs the
microbatches PipelineRunner's schedules would cut).

The facts are analysis/batch_wide.py's, from the traced graph. Here: before the first step, one
MicrobatchWarning naming the modules (BatchNorm in training, random ops) and the loss's reduction,
the same lines for the report; with batch_norm="refuse", a UsageError where a BatchNorm would
normalize microbatches; and how the microbatches' losses combine into the full batch's
(runtime/microbatch_step.weights).
"""
from __future__ import annotations

from ..analysis.batch_wide import BatchWide, LossReduction, traced_loss
from ..errors import MicrobatchWarning, OptionError, UsageError, warn
from .microbatch_step import reduction_of

BATCH_NORM = ("warn", "refuse")


def check_batch_norm(value: str) -> str:
    if value not in BATCH_NORM:
        raise OptionError(f"batch_norm must be one of {', '.join(map(repr, BATCH_NORM))} (what to do where a "
                          f"BatchNorm in training would normalize microbatches), got {value!r}.")
    return value


def check_microbatching(wide: BatchWide | None, microbatches: int, batch_norm: str, who: str) -> list[str]:
    """For a batch run as `microbatches` pieces: refuse (batch_norm="refuse") or warn once; the
    lines for the report's notes."""
    if wide is None or microbatches <= 1:
        return []
    if wide.batch_norms and batch_norm == "refuse":
        raise UsageError(f"{who} runs the batch as {microbatches} microbatches, and {', '.join(wide.batch_norms)} "
                         "would normalize each by its own statistics (batch_norm='refuse'): replace them with "
                         "GroupNorm or LayerNorm, which do not depend on the batch, or keep the batch whole "
                         "(microbatches=1, or no stages).")
    notes = wide.notes(microbatches)
    if notes:
        warn(f"{who} runs the batch as {microbatches} microbatches: " + "; ".join(notes) + ".", MicrobatchWarning)
    return [f"{who}: {note}" for note in notes]


def loss_kind(wide: BatchWide | None, declared: str | None, outside: bool) -> tuple[str, LossReduction | None]:
    """How train_step combines its microbatches' losses, and the graph's loss it weighs by: the
    graph's own reduction where it reads one; `declared` (train_step's reduction=) must agree
    with it; a loss outside the graph (loss_fn), or one not read, reduces as declared, else as a
    mean."""
    loss = None if outside else traced_loss(wide)
    if loss is None or loss.kind == "unknown":
        return declared or reduction_of(None), None
    found = reduction_of(loss)
    if declared is not None and (declared == "sum") != (found == "sum"):
        raise OptionError(f"reduction={declared!r}, but the model's loss {loss.node} is {loss.how}, "
                          f"{'a sum' if found == 'sum' else 'a mean'} over the batch: leave reduction out "
                          "(graphopt reads it from the graph), or give the one the loss has.")
    return found, loss
