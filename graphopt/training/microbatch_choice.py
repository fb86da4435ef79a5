"""train_step's planning: the fewest equal microbatches whose planned step fits the budget.

  1. k = 1, 2, 3, ... over the values that split every batched input into equal parts
     (batch.microbatch_counts).
  2. For each, graphopt.optimize plans recompute on the first microbatch. From the second
     microbatch on every gradient is resident while the next one runs, and backward adds into
     it in place: for k > 1 the plan is made so (optimize(..., accumulate=True)).
  3. The user's step on one microbatch (the graph, the loss, the scaled backward:
     runtime/microbatch_step.py) is run on FakeTensors under the instrument the estimate uses
     (_predicted_peak): a loss_fn outside the graph allocates what the plan never saw. Over the
     budget, plan again for a budget lowered by the overshoot (at most REPLANS times).
  4. The first k whose step fits is kept; BudgetError from each k is caught and the next tried.
     With an optimizer, every k is tried with it on the device first, then again with its state
     and step free to move to the host (recompute's step 9), which costs more a step than
     microbatches do; a rank's step (world_size) likewise, then with its shards free to move
     (recompute's step 11).
     When none fits, down to one row per microbatch, BudgetError names the least budget of any
     k and its k (one row each, unless accumulated gradients outweigh the activations saved).
     A k whose microbatch the model does not run on (BatchNorm1d on one row) is skipped.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import torch

from ..analysis.fake_state import fake_run
from ..analysis.memory import below_least, headroom, held_to, measure_peak, predict_peak, size_text
from ..analysis.meta import graph_device
from ..analysis.optimizer_memory import optimizer_memory
from ..analysis.planning_device import planning_device
from ..analysis.trial import tensor_leaves, trial_run
from ..api import optimize_with
from ..errors import BudgetError, BudgetWarning, TraceError, UsageError
from ..frontend.batch import why_unsplittable
from ..passes.options import OptimizeOptions
from ..passes.shard.rank_memory import RANK_ADVICE, rank_peak
from ..runtime.microbatch import split_batch
from ..runtime.microbatch_step import accumulate
from ..runtime.step import step_loss
from ..vocabulary.sizes import in_gb

REPLANS = 3  # plans again for a lower budget after a predicted step over it


class MicrobatchChoice:
    """The graph for train_step's microbatches: `choose` the fewest that fit the budget, or take a
    count given (`fixed`); `plan` is one count's graph. It leaves microbatches, the chosen step's
    predicted peak (predicted_peak_bytes) and notes (the decision, as lines). With shard='fsdp'
    and world_size=N (`ranks`), the step and budget are a rank's under FSDP2."""

    def __init__(self, model: torch.nn.Module, example: tuple[tuple, dict], loss_fn, options: OptimizeOptions,
                 settings: dict):
        """options: the passes' options (the budget in them, in bytes); settings: optimize()'s others."""
        self.model, self.loss_fn, self.budget = model, loss_fn, options.budget_bytes
        self._example, self._options, self._settings = example, options, settings
        self.microbatches = 1
        self.notes: list[str] = []
        self.predicted_peak_bytes: int | None = None
        self._needs: dict[int, int] = {}  # k -> least budget of its step, where known exactly
        # a rank's step under FSDP2 (shard='fsdp', world_size=N): the budget is a rank's
        self.ranks = options.world_size

    def fixed(self, k: int):
        """The graph for k microbatches as given; BudgetError naming their least where it does not fit."""
        self.microbatches = k
        try:
            return self.plan(k)
        except BudgetError as e:
            raise self.refusal(k, self.least(k, e), e, f" in {k} microbatch{'es' if k > 1 else ''}") from None

    def choose(self, choices: list[int]):
        """The graph for the fewest of `choices` (microbatch counts) whose step fits the budget
        (1 without one); BudgetError naming the least of any where none does."""
        if self.budget is None:
            self.microbatches = 1
            return self.plan(1)
        may_move = not (self._options.calibrate or self._settings.get("cuda_graphs"))
        if not self._options.optimizer_on_device and may_move:
            # every count with everything on the device first: the optimizer's step on the host (a rank's
            # shards) costs more a step than microbatches do (analysis/host_step.py), and checkpoints on
            # the host cost copies
            self._options = dataclasses.replace(self._options, optimizer_on_device=True)
            try:
                return self.choose(choices)
            except BudgetError:
                self.notes.clear()
                self._needs.clear()  # the counts' leasts with the optimizer on the device
            finally:
                self._options = dataclasses.replace(self._options, optimizer_on_device=False)
        refused, untraced = {}, {}
        for k in choices:
            try:
                graph = self.plan(k)
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
                leasts = ", ".join(f"{j} with a least of {size_text(e.min_budget_bytes)}"
                                   for j, e in refused.items())
                self.notes.insert(0, f"microbatches: {k}, the fewest whose step fits budget_gb={in_gb(self.budget):g} "
                                     f"(refused: {leasts})")
            return graph
        if choices == [1]:
            why = why_unsplittable(*self._example) or "it has one row"
            raise self.refusal(1, self.least(1, refused[1]), refused[1],
                                f" as one batch (train_step cannot split it into microbatches: {why})")
        # the least of any k: where parameters outweigh activations, one microbatch needs least
        best = min(refused, key=lambda k: refused[k].min_budget_bytes)
        tried = ", ".join(map(str, refused))
        failed = "".join(f"; {k} microbatches do not trace ({why})" for k, why in untraced.items())
        raise self.refusal(best, self.least(best, refused[best]), refused[best],
                            f" in any number of equal microbatches (tried {tried}{failed}), the least with {best}")

    def refusal(self, k: int, least: int, e: BudgetError, where: str) -> BudgetError:
        """where: how the step was split ("in 2 microbatches"), after "needs at least"."""
        accumulated = ", gradients accumulated" if k > 1 else ""
        if self.ranks:
            return below_least(self.budget, least, f"one rank's training step under FSDP2 over {self.ranks} ranks "
                               f"needs at least{where}{accumulated}, by the estimate", e.breakdown, RANK_ADVICE,
                               e.headroom)
        return below_least(self.budget, least, f"one training step needs at least{where}{accumulated}, by the "
                           "estimate", e.breakdown, headroom=e.headroom)

    def plan(self, k: int):
        """The optimized graph for microbatches of 1/k of the batch; BudgetError when its step
        does not fit the budget."""
        if self.budget is None:
            args, kwargs = self._microbatch(k)
            return optimize_with(self.model, args, kwargs, self._options, **self._settings)
        limit = self.budget
        budget, lowered, least = limit, 0, None
        for _ in range(REPLANS + 1):
            try:
                graph, predicted = self._optimize(k, budget)
            except BudgetError as e:
                if not lowered:  # the graph alone does not fit: refused as optimize() refuses it
                    raise
                least = e.min_budget_bytes
                break
            if predicted <= self._target(graph, limit):
                return self._fits(graph, predicted, lowered)
            lowered += predicted - self._target(graph, limit)  # and plan below it by as much
            budget = limit - lowered
            if budget <= 0:
                break
        # Lowering did not find it: the tightest plan holds the step around the graph if any does.
        least = least if least is not None else self._planner_least(k)
        graph, predicted = self._optimize(k, least)
        if predicted <= self._target(graph, limit):
            return self._fits(graph, predicted, lowered)
        self._needs[k] = self._needed(graph, predicted, least)
        raise BudgetError(f"the step around the graph (the loss outside it) takes the tightest plan for {k} "
                          f"microbatch(es) to {size_text(predicted)}, over budget_gb={in_gb(self.budget):g}.",
                          min_budget_bytes=self._needs[k])

    def _fits(self, graph, predicted: int, lowered: int):
        self.predicted_peak_bytes = predicted
        if lowered:
            self.notes.append(f"planned for a lower budget: the step around the graph (the loss outside it) needs "
                              f"up to {size_text(lowered)} more than the graph's plan")
        return graph

    def least(self, k: int, refused: BudgetError) -> int:
        """Bytes of the least budget for k microbatches: the planner's least, or, where the step
        around the graph (a loss outside it) adds to its tightest plan, that step's."""
        if k in self._needs:
            return self._needs[k]
        least = refused.min_budget_bytes
        try:
            graph, predicted = self._optimize(k, least)
        except BudgetError:
            return least
        return self._needed(graph, predicted, least)

    def _needed(self, graph, predicted: int, budget: int) -> int:
        """The budget a plan made for `budget` needs for a step predicted at `predicted` bytes."""
        return max(budget, math.ceil(predicted * budget / self._target(graph, budget)))

    def _planner_least(self, k: int) -> int:
        """Bytes of the least budget the planner names for k microbatches."""
        try:
            self._optimize(k, 1)  # a byte: nothing fits, and the refusal names the least
        except BudgetError as e:
            return e.min_budget_bytes
        return 1

    @staticmethod
    def _target(graph, budget: int) -> int:
        """The bytes a plan for `budget` is held to: less the headroom of the device it is planned
        for (CUDA keeps some free) and what the graph's CUDA graphs hold beyond the step (the bytes
        recompute's BudgetFit planned below its own budget less headroom)."""
        kept = headroom(graph_device(graph))
        record = graph.graphopt_report.recompute()
        fit = record.budget if record is not None else None
        reserve = held_to(fit.budget_bytes, kept) - fit.planned_for_bytes if fit is not None else 0
        return held_to(budget, kept) - reserve

    def _microbatch(self, k: int) -> tuple[tuple, dict]:
        return self._example if k == 1 else split_batch(*self._example, k)[0]

    def _optimize(self, k: int, budget: int):
        """(graph, predicted peak of the user's step) for microbatches of 1/k at `budget` bytes: from
        the second microbatch on every gradient is resident, and the plan is made so."""
        args, kwargs = self._microbatch(k)
        with warnings.catch_warnings():
            if k > 1 or budget != self.budget:  # train_step's own search: it says nothing of the user's budget
                warnings.simplefilter("ignore", BudgetWarning)
            graph = optimize_with(self.model, args, kwargs,
                                  dataclasses.replace(self._options, budget_bytes=budget, accumulate=k > 1),
                                  **self._settings)
        return graph, self._predicted_peak(graph, args, kwargs, k, self._options.optimizer)

    def _predicted_peak(self, graph, args, kwargs, k: int, optimizer) -> int:
        """Peak bytes of one microbatch's step as __call__ runs it, with every gradient present for
        k > 1: on FakeTensors under the estimate's instrument, or, where the loss does not run on
        them (a .item(), say), measured on one real step that leaves no trace."""
        if self.ranks:
            return self._rank_peak(graph, args, kwargs, k, optimizer)
        host = graph.graphopt_report.host_step  # the optimizer stepped on the host: its memory is not the device's
        on_device = optimizer is not None and host is None
        extra = optimizer_memory(optimizer, list(self.model.parameters())) if on_device else None
        host_gradients = host is not None and host.gradients  # and none resident on the device, accumulating or not

        def run(a, kw):  # a microbatch after the first: the running total exists
            total = torch.zeros((), device=tensor_leaves((a, kw))[0].device) if k > 1 else None
            accumulate(step_loss(graph, a, kw, self.loss_fn), total, 1.0 / k)  # the weight moves no memory

        try:
            with _gradients(self.model, present=k > 1 and not host_gradients), \
                    fake_run(graph, (args, kwargs)) as (mode, (fa, fkw)):
                grads = [p.grad for p in graph.parameters() if p.grad is not None]
                return predict_peak(lambda: run(fa, fkw), mode,
                                    [*graph.parameters(), *graph.buffers(), *grads, *tensor_leaves((fa, fkw))], extra,
                                    list(graph.parameters()) if host_gradients else None)
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
            with trial_run(self.model, (args, kwargs)), _gradients(self.model, present=k > 1 and not host_gradients):
                peak = measure_peak(lambda: run(args, kwargs), self.model, *tensor_leaves((args, kwargs)))
            return peak + (extra.state_bytes + extra.step_bytes if extra is not None else 0)

    def _rank_peak(self, graph, args, kwargs, k: int, optimizer) -> int:
        """What a rank's step as __call__ runs it may hold (shard/rank_memory.py): its microbatches'
        backwards into sharded gradients, the loss outside the graph in it."""
        def loss(module, a, kw):
            return step_loss(module, a, kw, self.loss_fn) * (1.0 / k)

        try:
            return rank_peak(graph, args, kwargs, self.ranks, optimizer, accumulate=k > 1, loss=loss).bound_bytes
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 (a loss_fn that needs real values): no rank's step to measure here
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            raise UsageError(f"with world_size=, a rank's step is estimated on FakeTensors over a fake process group, "
                             f"and the loss around the graph does not run on them ({why}): give a loss_fn that "
                             "computes from tensors alone (no .item(), no Python branch on a value).") from None


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
