"""train_step(): one training step (forward, loss, backward) that fits a memory budget, split
into the fewest equal microbatches whose planned step fits when the full batch does not.

    step = graphopt.train_step(model, (x,), example_kwargs={"labels": y}, budget_gb=2)
    loss = step(x, labels=y)          # .grad holds the full batch's gradients
    optimizer.step(); optimizer.zero_grad()

How k is chosen (microbatches="auto" with budget_gb): microbatch_choice.py. Each microbatch's
backward, scaled for the reduction: runtime/microbatch_step.py.
"""
from __future__ import annotations

import inspect
import numbers
from typing import Callable

import torch

from ..api import checked_options, optimize_with
from ..errors import OptionError, UsageError
from ..frontend.batch import batch_rows, microbatch_counts, splits_evenly, why_unsplittable
from ..frontend.call_signature import signature
from ..frontend.export_batch import ExportCache, kept_exports, keeping_exports
from ..frontend.trace import check_inputs
from ..passes.options import ARGUMENTS
from ..runtime.fsdp import sharded
from ..runtime.guards import describe_call
from ..runtime.microbatch import split_batch
from ..runtime.microbatch_semantics import check_microbatching, check_batch_norm, loss_kind
from ..runtime.microbatch_step import REDUCTIONS, accumulate, loss_weights
from ..runtime.step import step_loss
from ..vocabulary.sizes import in_gb
from .microbatch_choice import MicrobatchChoice


def train_step(model: torch.nn.Module, example_inputs, example_kwargs: dict | None = None, *,
               loss_fn: Callable | None = None, budget_gb: float | None = None, microbatches="auto",
               reduction: str | None = None, **optimize_options) -> "TrainStep":
    """A callable running one training step of `model`; see TrainStep."""
    return TrainStep(model, example_inputs, example_kwargs, loss_fn=loss_fn, budget_gb=budget_gb,
                     microbatches=microbatches, reduction=reduction, **optimize_options)


class TrainStep:
    """`loss = step(*args, **kwargs)`: forward and backward of one training step on the batch,
    as `microbatches` equal microbatches run one after another through `graph`, the optimized
    GraphModule planned on one microbatch. Returns the detached loss of the whole batch and
    leaves its gradients in the parameters' .grad, added to what is there, as backward() does.

    loss_fn(output, *args, **kwargs) -> scalar loss, called with each microbatch's arguments;
    by default the output's `.loss` (or ["loss"]), or the output when it is a scalar.

    How the microbatches' losses combine (each one's backward weighted by its share of the full
    batch's loss, the returned loss their weighted sum) follows how the loss reduces over the
    batch, read from the graph when the model computes it (analysis/batch_wide.py):
      a mean over rows: each weighs 1/k, the full batch's mean over equal microbatches;
      a sum: each weighs 1;
      a mean over the targets not ignored (cross-entropy's ignore_index, transformers' -100
        labels): each weighs its share of the batch's counted targets, so the gradients are the
        full batch's mean even where padding is spread unevenly.
    reduction ("mean" or "sum") declares it for a loss_fn outside the model, or a loss the graph
    does not show; given for a loss the graph shows, it must agree (OptionError). Default: as
    read, else "mean".
    Where the model depends on the batch as a whole, k > 1 changes the result, and a
    MicrobatchWarning (and `notes`) says so, naming the modules: BatchNorm in training
    normalizes each microbatch by its own statistics and updates its running statistics once
    per microbatch (batch_norm="refuse" raises instead); random ops draw microbatch after
    microbatch.

    budget_gb covers the step as the user runs it with .grad None before (optimizer.zero_grad()'s
    default) and, for k > 1, with every gradient resident from the second microbatch on.
    With budget_gb the graph is planned for the example's shapes: the step takes batches of
    those shapes only. microbatches: "auto" (the fewest that fit; 1 without budget_gb) or an
    int that splits the batch into equal parts. Other keyword arguments go to
    graphopt.optimize (passes, precision, optimizer, frontend, ...).

    With shard="fsdp" and world_size=N (options for graphopt.optimize), budget_gb is one rank's
    under FSDP2 and k is chosen by a rank's step (the microbatches' backwards accumulating into
    the sharded gradients); shard the graph with graphopt.runtime.fsdp.fully_shard_units before
    the first call, which refuses an unsharded one.

    Attributes: microbatches (k), graph, report (graph.graphopt_report, whose notes end with
    train_step's), notes (the microbatch decision and warnings, as lines), predicted_peak_bytes
    (with budget_gb; a rank's with the collective slack the plan holds), world_size (with shard),
    reduction (how the microbatches' losses combined), whole (whether the step
    gives the full batch's loss and gradients, not only its microbatches').
    """

    def __init__(self, model, example_inputs, example_kwargs=None, *, loss_fn=None, budget_gb=None,
                 microbatches="auto", reduction=None, **optimize_options):
        args, kwargs = check_inputs(model, example_inputs, example_kwargs)
        settings = _checked_settings(model, loss_fn, reduction, budget_gb, optimize_options)
        options = checked_options({"budget_gb": budget_gb, **{k: v for k, v in optimize_options.items()
                                                               if k in ARGUMENTS}})
        self.model, self.loss_fn, self.budget_bytes = model, loss_fn, options.budget_bytes
        self._example = (args, kwargs)
        self._planned = signature(args, kwargs)
        choice = MicrobatchChoice(model, (args, kwargs), loss_fn, options, settings)
        # one export serves the microbatch counts its dynamic batch takes (and a caller's other steps: plan's)
        with keeping_exports(kept_exports() or ExportCache()):
            if isinstance(microbatches, str) and microbatches == "auto":
                self.graph = choice.choose(microbatch_counts(args, kwargs))
            else:
                self.graph = choice.fixed(_check_microbatches(microbatches, args, kwargs))
        self.microbatches, self.notes, self.predicted_peak_bytes = \
            choice.microbatches, choice.notes, choice.predicted_peak_bytes
        self.world_size = choice.ranks
        self.report = self.graph.graphopt_report
        self.report.microbatches = self.microbatches
        # how the microbatches' losses combine: the graph's loss's reduction, or the one declared
        self.reduction, self._loss = loss_kind(self.report.batch_wide, reduction, outside=loss_fn is not None)
        # the full batch's result, not only its microbatches': nothing batch-wide, the loss read and combined exactly
        self.whole = self.microbatches == 1 or (self._loss is not None and self.report.batch_wide.whole)
        self.notes += check_microbatching(self.report.batch_wide, self.microbatches, settings.get("batch_norm", "warn"),
                                          "train_step")
        self.report.notes += [f"train_step: {self._shape_text()}", *self.notes]

    # -- running ---------------------------------------------------------------------------

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if self.world_size and not sharded(self.graph):
            raise UsageError(f"this train step was planned for one rank of FSDP2 over {self.world_size} ranks, and its "
                             "graph's units are not sharded: call graphopt.runtime.fsdp.fully_shard_units(step.graph, "
                             "mesh=...) on every rank first, then build the optimizer over step.graph.parameters().")
        total, parts = None, self._split(args, kwargs)
        shares = loss_weights(self.graph, parts, self.reduction, self._loss)  # weights(), split once
        for i, (a, kw) in enumerate(parts):
            try:
                loss = step_loss(self.graph, a, kw, self.loss_fn)
            except UsageError as e:
                if i:
                    raise
                raise UsageError(f"train_step ({self._shape_text()}): {e}") from None
            total = accumulate(loss, total, shares[i])
            del loss  # before the next microbatch's forward, as its backward freed the rest
        return total

    def weights(self, *args, **kwargs) -> list[float]:
        """Each microbatch's weight in this batch's loss, as a call weighs them (1/k for a mean, 1
        for a sum, its share of the counted targets for a mean over them)."""
        parts = self._split(args, kwargs)
        return loss_weights(self.graph, parts, self.reduction, self._loss)

    def _split(self, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        k = self.microbatches
        if self.budget_bytes is not None and signature(args, kwargs) != self._planned:
            raise UsageError(f"this train step was planned for inputs {describe_call(*self._example)} "
                             f"({self._shape_text()}, budget_gb={in_gb(self.budget_bytes):g}), and got "
                             f"{describe_call(args, kwargs)}: call it with batches of those shapes, or build another "
                             "train_step for these.")
        if k == 1:
            return [(args, kwargs)]
        if why_unsplittable(args, kwargs) or not splits_evenly(args, kwargs, k):
            raise UsageError(f"this train step splits each batch into {k} equal microbatches along dim 0 of every "
                             f"tensor input, and the call's inputs {describe_call(args, kwargs)} do not split so: "
                             f"give a batch whose rows {k} divides, or build a train_step with microbatches= for it.")
        return split_batch(args, kwargs, k)

    def _shape_text(self) -> str:
        k = self.microbatches
        return "the whole batch at once" if k == 1 else f"{k} equal microbatches, one after another"

    def __str__(self) -> str:
        return str(self.report)


# -- helpers --------------------------------------------------------------------------------


def _checked_settings(model, loss_fn, reduction, budget_gb, options: dict) -> dict:
    """What train_step adds to optimize()'s arguments, checked, and the arguments it takes that ask
    for no pass (frontend, verify, ...), as optimize_with takes them; those that ask for passes
    are checked_options's."""
    if loss_fn is not None and not callable(loss_fn):
        raise UsageError(f"loss_fn must be a function of (output, *args, **kwargs) returning the scalar loss, "
                         f"got {type(loss_fn).__name__}.")
    check_batch_norm(options.get("batch_norm", "warn"))
    if reduction is not None and reduction not in REDUCTIONS:
        raise OptionError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))} (how the loss reduces "
                          f"over rows), got {reduction!r}.")
    if options.get("stages") is not None:
        raise OptionError("train_step runs its microbatches on one device; for pipeline stages use "
                          "graphopt.optimize(..., stages=N) with graphopt.runtime.pipeline.PipelineRunner.")
    train = options.get("train")
    if train is False:
        raise OptionError("train_step builds a training step: leave train= out, or give train=True.")
    if budget_gb is not None and not model.training and train is not True:
        raise UsageError("the model is in eval mode, where budget_gb plans a forward without backward: call "
                         "model.train() (or pass train=True) so the plan covers the training step.")
    if "accumulate" in options:
        raise OptionError("train_step plans its microbatches with the accumulated gradients resident itself: "
                          "leave accumulate out.")
    unknown = sorted(set(options) - set(ARGUMENTS) - set(SETTINGS))
    if unknown:
        raise TypeError(f"train_step() got an unexpected keyword argument {unknown[0]!r}")
    return {k: v for k, v in options.items() if k in SETTINGS}


# optimize()'s arguments that ask for no pass, which train_step hands on as they are
SETTINGS = tuple(name for name, p in inspect.signature(optimize_with).parameters.items() if p.kind == p.KEYWORD_ONLY)


def _check_microbatches(value, args: tuple, kwargs: dict) -> int:
    choices, why = microbatch_counts(args, kwargs), why_unsplittable(args, kwargs)
    what = f"the batch's {batch_rows(args, kwargs)} rows" if not why else f"this batch, which does not split ({why}),"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value not in choices:
        raise OptionError(f"microbatches must be 'auto' or a number of equal microbatches that splits {what} "
                          f"along dim 0: {', '.join(map(str, choices))}; got {value!r}.")
    return int(value)
