"""train_step(): one training step (forward, loss, backward) that fits a memory budget, split
into the fewest equal microbatches whose planned step fits when the full batch does not.

    step = graphopt.train_step(model, (x,), example_kwargs={"labels": y}, budget_gb=2)
    loss = step(x, labels=y)          # .grad holds the full batch's gradients
    optimizer.step(); optimizer.zero_grad()

How k is chosen (microbatches="auto" with budget_gb):
  1. k = 1, 2, 3, ... over the values that split every batched input (each tensor input with
     a dimension, along dim 0, as runtime/microbatch.py splits it) into equal parts.
  2. For each, graphopt.optimize plans recompute on the first microbatch. From the second
     microbatch on every gradient is resident while the next one runs, and backward adds into
     it in place: for k > 1 the plan is made so (optimize(..., accumulate=True)).
  3. The user's step on one microbatch (the graph, the loss, the scaled backward) is run on
     FakeTensors under the instrument the estimate uses (_predicted_peak): a loss_fn outside
     the graph allocates what the plan never saw. Over the budget, plan again for a budget
     lowered by the overshoot (at most REPLANS times).
  4. The first k whose step fits is kept; BudgetError from each k is caught and the next tried.
     When none fits, down to one row per microbatch, BudgetError names the least budget of any
     k and its k (one row each, unless accumulated gradients outweigh the activations saved).
     A k whose microbatch the model does not run on (BatchNorm1d on one row) is skipped.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from typing import Callable

import torch

from .analysis.fake_state import fake_run
from .analysis.memory import GB, below_least, budget_bytes, measure_peak, predict_peak, size_text
from .analysis.optimizer_memory import check_optimizer, optimizer_memory
from .analysis.planning_device import planning_device
from .api import optimize
from .batch import batch_rows, microbatch_counts, splits_evenly, why_unsplittable
from .call_signature import signature
from .errors import BudgetError, BudgetWarning, OptionError, TraceError, UsageError
from .export_batch import ExportCache, kept_exports, keeping_exports
from .passes.recompute.recompute_pass import Recompute
from .runtime.guards import describe
from .runtime.microbatch import split_batch
from .runtime.step import step_loss
from .trace import check_inputs
from .trial import tensor_leaves, trial_run

REDUCTIONS = ("mean", "sum")
REPLANS = 3  # plans again for a lower budget after a predicted step over it


def train_step(model: torch.nn.Module, example_inputs, example_kwargs: dict | None = None, *,
               loss_fn: Callable | None = None, budget_gb: float | None = None, microbatches="auto",
               reduction: str = "mean", **optimize_options) -> "TrainStep":
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

    reduction says how the loss reduces over rows, and so how microbatches combine:
      "mean" (default): each microbatch's loss is scaled by 1/k before its backward, so the
        accumulated gradients are those of the mean over the batch; the returned loss is the
        mean of the microbatch losses. Exact when every microbatch's loss is a mean over the
        same number of terms: a loss averaged over a count that varies per microbatch (tokens
        not masked by ignore_index, say) weighs the microbatches otherwise than the full batch.
      "sum": no scaling, the gradients of a sum over rows add up; the returned loss is the sum.
    BatchNorm in training normalizes by each microbatch's statistics, not the batch's, and
    updates its running statistics once per microbatch: gradients differ from the full batch's
    (a UserWarning says so when k > 1, and `notes` keeps it).

    budget_gb covers the step as the user runs it with .grad None before (optimizer.zero_grad()'s
    default) and, for k > 1, with every gradient resident from the second microbatch on.
    With budget_gb the graph is planned for the example's shapes: the step takes batches of
    those shapes only. microbatches: "auto" (the fewest that fit; 1 without budget_gb) or an
    int that splits the batch into equal parts. Other keyword arguments go to
    graphopt.optimize (passes, precision, optimizer, frontend, ...).

    Attributes: microbatches (k), graph, report (graph.graphopt_report, whose notes end with
    train_step's), notes (the microbatch decision and warnings, as lines), predicted_peak_bytes
    (with budget_gb).
    """

    def __init__(self, model, example_inputs, example_kwargs=None, *, loss_fn=None, budget_gb=None,
                 microbatches="auto", reduction="mean", **optimize_options):
        args, kwargs = check_inputs(model, example_inputs, example_kwargs)
        budget_gb = _checked_budget(budget_gb)
        self._options = _checked_options(model, loss_fn, reduction, budget_gb, optimize_options)
        self.model, self.loss_fn, self.reduction, self.budget_gb = model, loss_fn, reduction, budget_gb
        self._example = (args, kwargs)
        self._planned = signature(args, kwargs)
        self.notes: list[str] = []
        self.predicted_peak_bytes: int | None = None
        self._needs: dict[int, int] = {}  # k -> least budget of its step, where known exactly
        # one export serves the microbatch counts its dynamic batch takes (and a caller's other steps: plan's)
        with keeping_exports(kept_exports() or ExportCache()):
            if isinstance(microbatches, str) and microbatches == "auto":
                self.graph = self._choose(microbatch_counts(args, kwargs))
            else:
                self.microbatches = k = _check_microbatches(microbatches, args, kwargs)
                try:
                    self.graph = self._plan(k)
                except BudgetError as e:
                    raise self._refusal(k, self._least(k, e), e, f" in {k} microbatch{'es' if k > 1 else ''}") from None
        self.report = self.graph.graphopt_report
        self.report.microbatches = self.microbatches
        self._warn_batchnorm()
        self.report.notes += [f"train_step: {self._shape_text()}", *self.notes]

    # -- choosing k -----------------------------------------------------------------------

    def _choose(self, choices: list[int]):
        if self.budget_gb is None:
            self.microbatches = 1
            return self._plan(1)
        refused, untraced = {}, {}
        for k in choices:
            try:
                graph = self._plan(k)
            except BudgetError as e:
                refused[k] = e
                continue
            except TraceError as e:  # a microbatch the model does not run on (BatchNorm on one row)
                if k == 1:
                    raise
                untraced[k] = str(e).splitlines()[-1].strip()
                continue
            self.microbatches = k
            if refused:
                leasts = ", ".join(f"{j} with a least of {size_text(int(e.min_budget_gb * GB))}"
                                   for j, e in refused.items())
                self.notes.insert(0, f"microbatches: {k}, the fewest whose step fits budget_gb={self.budget_gb:g} "
                                     f"(refused: {leasts})")
            return graph
        if choices == [1]:
            why = why_unsplittable(*self._example) or "it has one row"
            raise self._refusal(1, self._least(1, refused[1]), refused[1],
                                f" as one batch (train_step cannot split it into microbatches: {why})")
        # the least of any k: where parameters outweigh activations, one microbatch needs least
        best = min(refused, key=lambda k: refused[k].min_budget_gb)
        tried = ", ".join(map(str, refused))
        failed = "".join(f"; {k} microbatches do not trace ({why})" for k, why in untraced.items())
        raise self._refusal(best, self._least(best, refused[best]), refused[best],
                            f" in any number of equal microbatches (tried {tried}{failed}), the least with {best}")

    def _refusal(self, k: int, least: int, e: BudgetError, where: str) -> BudgetError:
        """where: how the step was split ("in 2 microbatches"), after "needs at least"."""
        accumulated = ", gradients accumulated" if k > 1 else ""
        return below_least(self.budget_gb, least, f"one training step needs at least{where}{accumulated}, by the "
                           "estimate", e.breakdown)

    def _plan(self, k: int):
        """The optimized graph for microbatches of 1/k of the batch; BudgetError when its step
        does not fit the budget."""
        if self.budget_gb is None:
            args, kwargs = self._microbatch(k)
            return optimize(self.model, args, example_kwargs=kwargs, **self._options)
        limit = budget_bytes(self.budget_gb)
        budget, lowered, least = self.budget_gb, 0, None
        for _ in range(REPLANS + 1):
            try:
                graph, predicted = self._optimize(k, budget)
            except BudgetError as e:
                if not lowered:  # the graph alone does not fit: refused as optimize() refuses it
                    raise
                least = e.min_budget_gb
                break
            if predicted <= self._target(graph, limit):
                return self._fits(graph, predicted, lowered)
            lowered += predicted - self._target(graph, limit)  # and plan below it by as much
            budget = self.budget_gb - lowered / GB
            if budget <= 0:
                break
        # Lowering did not find it: the tightest plan holds the step around the graph if any does.
        least = least if least is not None else self._planner_least(k)
        graph, predicted = self._optimize(k, least)
        if predicted <= self._target(graph, limit):
            return self._fits(graph, predicted, lowered)
        self._needs[k] = self._needed(graph, predicted, math.ceil(least * GB))
        raise BudgetError(f"the step around the graph (the loss outside it) takes the tightest plan for {k} "
                          f"microbatch(es) to {size_text(predicted)}, over budget_gb={self.budget_gb:g}.",
                          min_budget_gb=self._needs[k] / GB)

    def _fits(self, graph, predicted: int, lowered: int):
        self.predicted_peak_bytes = predicted
        if lowered:
            self.notes.append(f"planned for a lower budget: the step around the graph (the loss outside it) needs "
                              f"up to {size_text(lowered)} more than the graph's plan")
        return graph

    def _least(self, k: int, refused: BudgetError) -> int:
        """Bytes of the least budget for k microbatches: the planner's least, or, where the step
        around the graph (a loss outside it) adds to its tightest plan, that step's."""
        if k in self._needs:
            return self._needs[k]
        least = math.ceil(refused.min_budget_gb * GB)
        try:
            graph, predicted = self._optimize(k, least / GB)
        except BudgetError:
            return least
        return self._needed(graph, predicted, least)

    def _needed(self, graph, predicted: int, budget: int) -> int:
        """The budget a plan made for `budget` needs for a step predicted at `predicted` bytes."""
        return max(budget, math.ceil(predicted * budget / self._target(graph, budget)))

    def _planner_least(self, k: int) -> float:
        try:
            self._optimize(k, 1e-9)
        except BudgetError as e:
            return e.min_budget_gb
        return 1e-9

    @staticmethod
    def _target(graph, budget: int) -> int:
        """The bytes a plan for `budget` is held to: less recompute's headroom (CUDA keeps some free)."""
        record = graph.graphopt_report.recompute()
        fit = record.budget if record is not None else None
        return budget if fit is None else int(budget * fit.planned_for_bytes / fit.budget_bytes)

    def _microbatch(self, k: int) -> tuple[tuple, dict]:
        return self._example if k == 1 else split_batch(*self._example, k)[0]

    def _optimize(self, k: int, budget_gb: float):
        """(graph, predicted peak of the user's step) for microbatches of 1/k at budget_gb: from
        the second microbatch on every gradient is resident, and the plan is made so."""
        args, kwargs = self._microbatch(k)
        options = dict(self._options)
        optimizer = options.pop("optimizer", None)
        with warnings.catch_warnings():
            if k > 1 or budget_gb != self.budget_gb:  # train_step's own search: it says nothing of the user's budget
                warnings.simplefilter("ignore", BudgetWarning)
            graph = optimize(self.model, args, example_kwargs=kwargs, budget_gb=budget_gb, optimizer=optimizer,
                             accumulate=k > 1, **options)
        return graph, self._predicted_peak(graph, args, kwargs, k, optimizer)

    def _predicted_peak(self, graph, args, kwargs, k: int, optimizer) -> int:
        """Peak bytes of one microbatch's step as __call__ runs it, with every gradient present for
        k > 1: on FakeTensors under the estimate's instrument, or, where the loss does not run on
        them (a .item(), say), measured on one real step that leaves no trace."""
        extra = optimizer_memory(optimizer, list(self.model.parameters())) if optimizer is not None else None

        def run(a, kw):  # a microbatch after the first: the running total exists
            total = torch.zeros((), device=tensor_leaves((a, kw))[0].device) if k > 1 else None
            self._accumulate(step_loss(graph, a, kw, self.loss_fn), total, k)

        try:
            with _gradients(self.model, present=k > 1), fake_run(graph, (args, kwargs)) as (mode, (fa, fkw)):
                grads = [p.grad for p in graph.parameters() if p.grad is not None]
                return predict_peak(lambda: run(fa, fkw), mode,
                                    [*graph.parameters(), *graph.buffers(), *grads, *tensor_leaves((fa, fkw))], extra)
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 (a loss_fn that needs real values): measure one real step
            if planning_device() is not None:
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                advice = ("a loss_fn that computes from tensors alone (no .item(), no Python branch on a value), and "
                          "the tensors it closes over (labels) built on the CPU, not on the meta device: they are "
                          "small, and a meta tensor outside the example inputs is not planned for the device)")
                raise UsageError(f"graphopt.plan runs the step on FakeTensors, and the loss around the graph does "
                                 f"not run on them ({why}): give {advice}.") from None
            with trial_run(self.model, (args, kwargs)), _gradients(self.model, present=k > 1):
                peak = measure_peak(lambda: run(args, kwargs), self.model, *tensor_leaves((args, kwargs)))
            return peak + (extra.state_bytes + extra.step_bytes if extra is not None else 0)

    def _warn_batchnorm(self) -> None:
        norms = [m for m in self.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        if self.microbatches > 1 and self.model.training and norms:
            note = (f"{len(norms)} BatchNorm module(s) normalize each of the {self.microbatches} microbatches by its "
                    "own batch statistics and update their running statistics once per microbatch: the step's "
                    "gradients and statistics differ from the full batch's")
            self.notes.append(note)
            warnings.warn(f"graphopt.train_step: {note}.", UserWarning, stacklevel=4)  # the caller of train_step()

    # -- running ---------------------------------------------------------------------------

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        total = None
        for i, (a, kw) in enumerate(self._split(args, kwargs)):
            try:
                loss = step_loss(self.graph, a, kw, self.loss_fn)
            except UsageError as e:
                if i:
                    raise
                raise UsageError(f"train_step ({self._shape_text()}): {e}") from None
            total = self._accumulate(loss, total, self.microbatches)
            del loss  # before the next microbatch's forward, as its backward freed the rest
        return total / self.microbatches if self.reduction == "mean" and self.microbatches > 1 else total

    def _accumulate(self, loss, total: torch.Tensor | None, k: int) -> torch.Tensor:
        """Backward of one microbatch's loss, scaled for the reduction; the running loss total."""
        self._backward(loss, self._scale(k))
        if total is None:  # a copy for k > 1: the total is added into
            return loss.detach() if k == 1 else loss.detach().clone()
        total += loss.detach()
        return total

    def _scale(self, k: int) -> float:
        return 1.0 / k if self.reduction == "mean" else 1.0

    @staticmethod
    def _backward(loss, scale: float) -> None:
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UsageError(f"the loss is {what}; train_step backpropagates a scalar floating tensor: make "
                             "loss_fn(output, *args, **kwargs) return one (reduce it with .mean() or .sum()).")
        if not loss.requires_grad:
            raise UsageError("the loss does not require grad (no parameter requires grad, or the loss is "
                             "detached): train_step needs a loss computed from the parameters it trains.")
        (loss if scale == 1.0 else loss * scale).backward()

    def _split(self, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        k = self.microbatches
        if self.budget_gb is not None and signature(args, kwargs) != self._planned:
            raise UsageError(f"this train step was planned for inputs {describe(*self._example)} "
                             f"({self._shape_text()}, budget_gb={self.budget_gb:g}), and got {describe(args, kwargs)}: "
                             "call it with batches of those shapes, or build another train_step for these.")
        if k == 1:
            return [(args, kwargs)]
        if why_unsplittable(args, kwargs) or not splits_evenly(args, kwargs, k):
            raise UsageError(f"this train step splits each batch into {k} equal microbatches along dim 0 of every "
                             f"tensor input, and the call's inputs {describe(args, kwargs)} do not split so: give a "
                             f"batch whose rows {k} divides, or build a train_step with microbatches= for it.")
        return split_batch(args, kwargs, k)

    def _shape_text(self) -> str:
        k = self.microbatches
        return "the whole batch at once" if k == 1 else f"{k} equal microbatches, one after another"

    def __str__(self) -> str:
        return str(self.report)


# -- helpers --------------------------------------------------------------------------------


def _checked_options(model, loss_fn, reduction, budget_gb, options: dict) -> dict:
    """The options for optimize(), after the checks of what train_step adds to them."""
    if loss_fn is not None and not callable(loss_fn):
        raise UsageError(f"loss_fn must be a function of (output, *args, **kwargs) returning the scalar loss, "
                         f"got {type(loss_fn).__name__}.")
    if reduction not in REDUCTIONS:
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
    if options.get("optimizer") is None:
        return dict(options)
    try:  # before any plan: the predicted step sizes its state too
        return {**options, "optimizer": check_optimizer(options["optimizer"])}
    except ValueError as e:
        raise OptionError(f"optimizer {e}.") from None


def _checked_budget(budget_gb) -> float | None:
    """budget_gb as optimize() validates it: by the recompute pass's option."""
    return None if budget_gb is None else Recompute.from_arguments({"budget_gb": budget_gb}).settings.budget_gb


def _check_microbatches(value, args: tuple, kwargs: dict) -> int:
    choices, why = microbatch_counts(args, kwargs), why_unsplittable(args, kwargs)
    what = f"the batch's {batch_rows(args, kwargs)} rows" if not why else f"this batch, which does not split ({why}),"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value not in choices:
        raise OptionError(f"microbatches must be 'auto' or a number of equal microbatches that splits {what} "
                          f"along dim 0: {', '.join(map(str, choices))}; got {value!r}.")
    return int(value)


@contextlib.contextmanager
def _gradients(model: torch.nn.Module, present: bool):
    """While open, every trainable parameter has a gradient (its own, or an uninitialized one:
    only its storage matters) when `present`, else none; as they were after. A FakeTensor run
    sees them: its backward then adds into them in place, as a microbatch after the first does."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = (p.grad if p.grad is not None else torch.empty_like(p)) if present else None
    try:
        yield
    finally:
        for p, g in zip(params, saved):
            p.grad = g
