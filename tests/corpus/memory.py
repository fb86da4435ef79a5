"""Memory on the real-model corpus: predicted against measured peaks, budgets held, and reach
against the model's own checkpointing. Shared by tests/test_corpus_memory.py and
bench/recompute_sweep.py.

The measured step is the user's: forward, the case's loss, backward, gradients None before
(live tensor storages on CPU, graphopt.runtime.step.step_peak). The corpus's batch is repeated
MEMORY_BATCH times so that activations, which recompute trades, outweigh parameters.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

import graphopt
from graphopt.analysis.memory import GB, estimate_peak
from graphopt.runtime.step import clear_grads, step_peak
from graphopt.testing.baselines import budget_at
from graphopt.frontend.graph_inputs import placeholder_values

from . import build
from .case import Case

MEMORY_BATCH = 8
FRACTIONS = (0.3, 0.5, 0.7)
ABOVE_LEAST = "1% above the least"  # the label of the point that holds a refusal to its least budget
WITHIN = 0.03  # the predicted peak is within 3% of the measured one
UNDER = 0.01   # and never under it by more than 1%


def memory_case(name: str) -> Case:
    return build(name).repeated(MEMORY_BATCH)


def user_step_peak(module: torch.nn.Module, case: Case) -> int:
    """Measured peak bytes of forward, the case's loss and backward; gradients None before and after."""
    torch.manual_seed(0)
    return step_peak(module, case.model, case.args, case.kwargs, lambda out, *args, **kwargs: case.loss(out))


def user_step(module: torch.nn.Module, case: Case, context=contextlib.nullcontext):
    """The user's step as a callable: forward, the case's loss, backward; gradients None before
    and after; run inside a fresh context(), such as own_checkpointing's."""
    def step():
        with context(case.model):
            clear_grads(case.model)
            case.loss(module(*case.args, **case.kwargs)).backward()
            clear_grads(case.model)
    return step


def step_flops(module, case) -> int:
    """Matmul and convolution FLOPs of one user step (torch.utils.flop_counter): the step's
    FLOPs less eager's are what recompute adds."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        case.loss(module(*case.args, **case.kwargs)).backward()
    clear_grads(case.model)
    return counter.get_total_flops()


@contextlib.contextmanager
def own_checkpointing(model: torch.nn.Module):
    """The model's own one-line checkpointing, on while the context is open: transformers'
    gradient_checkpointing_enable(), timm's set_grad_checkpointing(). Yields its name, or
    None for a model without one."""
    if getattr(model, "supports_gradient_checkpointing", False):
        # transformers 5 renamed it; the old name warns
        enable = "activation_checkpointing_enable" if hasattr(model, "activation_checkpointing_enable") \
            else "gradient_checkpointing_enable"
        getattr(model, enable)()
        try:
            yield f"{enable}()"
        finally:
            getattr(model, enable.replace("enable", "disable"))()
        return
    if hasattr(model, "set_grad_checkpointing"):
        try:
            model.set_grad_checkpointing(True)
        except (AssertionError, NotImplementedError):
            yield None
            return
        try:
            yield "set_grad_checkpointing()"
        finally:
            model.set_grad_checkpointing(False)
        return
    yield None


@dataclass
class Point:
    label: str                   # "no recompute", "f=0.5", "own checkpointing"
    budget: int | None           # bytes asked for (None: no budget)
    predicted: int | None = None
    measured: int | None = None  # of the optimized module's step
    refused: str = ""            # the BudgetError, when the budget was refused
    least: int | None = None     # the least budget the BudgetError names
    recomputed: int = 0          # nodes
    flops: int | None = None     # matmul and convolution FLOPs of the step, at own's peak
    own_flops: int | None = None # the same, of the step with the model's own checkpointing

    @property
    def error(self) -> float | None:
        if self.predicted is None or not self.measured:
            return None
        return (self.predicted - self.measured) / self.measured


def optimized_point(case: Case, label: str, budget: int | None, frontend: str = "auto") -> tuple[Point, torch.nn.Module | None]:
    kwargs = {"frontend": frontend} if budget is None else {"budget_gb": budget / GB, "frontend": frontend}
    try:
        opt = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, **kwargs)
    except graphopt.BudgetError as e:
        return Point(label, budget, refused=str(e).splitlines()[0][:160], least=e.min_budget_bytes), None
    if budget is None:
        predicted = estimate_peak(opt, placeholder_values(opt, case.args, case.kwargs)).peak_bytes
        recomputed = 0
    else:
        record = opt.graphopt_report.passes[-1]
        predicted, recomputed = record.peak_bytes, record.stats.get("recomputed_nodes", 0)
    return Point(label, budget, predicted, user_step_peak(opt, case), recomputed=recomputed), opt


def own_checkpointing_step(case: Case, flops: bool = True) -> tuple[str | None, int | None, int | None]:
    """The user's step with the model's own checkpointing on: (its name, measured peak, matmul and
    convolution FLOPs, or None without flops); (None, None, None) for a model without one."""
    with own_checkpointing(case.model) as name:
        if not name:
            return None, None, None
        return name, user_step_peak(case.model, case), step_flops(case.model, case) if flops else None


def memory_points(case: Case, fractions=FRACTIONS, own: bool = True, frontend: str = "auto",
                  flops: bool = False) -> list[Point]:
    """No recompute, then budgets of parameters + gradients + f of the rest of the predicted
    step, 1% above the least budget the first of them refused names (if one is), then the
    measured peak of the model's own checkpointing (and, with flops, the FLOPs of both steps
    at that peak)."""
    first, plain = optimized_point(case, "no recompute", None, frontend)
    points = [first]
    estimate = estimate_peak(plain, placeholder_values(plain, case.args, case.kwargs))
    budgets = [(f"f={f}", int(budget_at(estimate, f) * GB)) for f in fractions]
    points += [optimized_point(case, label, budget, frontend)[0] for label, budget in budgets]
    refused = next((p for p in points if p.refused), None)
    if refused:  # the first refusal's least only: a plan and a measured step more per model, not per fraction
        points.append(optimized_point(case, f"{ABOVE_LEAST} ({refused.label}'s)", int(refused.least * 1.01),
                                      frontend)[0])
    if own:
        name, own_peak, own_flops = own_checkpointing_step(case, flops)
        if name:
            point, opt = optimized_point(case, f"own: {name}", own_peak, frontend)
            if flops and opt is not None:
                point.flops, point.own_flops = step_flops(opt, case), own_flops
            points.append(point)
    return points


def point_problems(point: Point) -> list[str]:
    """What breaks the memory promise at one point: a fitted plan over its budget, an estimate
    off by more than WITHIN or under by more than UNDER, a refusal whose least budget is not
    above the budget asked for, or of 1% above a least budget named, or of the budget the model's
    own checkpointing meets; at that budget, a step that runs more matmul and convolution FLOPs
    than own's."""
    problems = []
    if point.refused:
        if point.least is None or point.least <= point.budget:
            problems.append(f"{point.label}: refused although its least budget {point.least} <= {point.budget}")
        if point.label.startswith(ABOVE_LEAST):
            problems.append(f"{point.label}: the {point.budget} bytes are refused too: {point.refused}")
        if point.label.startswith("own"):
            problems.append(f"{point.label}: graphopt refuses the {point.budget} bytes the model's own "
                            f"checkpointing meets; its least is {point.least}")
        return problems
    if point.budget is not None and point.measured > point.budget:
        problems.append(f"{point.label}: measured {point.measured} over the budget {point.budget}")
    if abs(point.error) > WITHIN or point.error < -UNDER:
        problems.append(f"{point.label}: predicted {point.predicted} vs measured {point.measured} "
                        f"({100 * point.error:+.2f}%)")
    if point.flops is not None and point.flops > point.own_flops:
        problems.append(f"{point.label}: the step runs {point.flops} matmul and convolution FLOPs, "
                        f"more than own checkpointing's {point.own_flops}")
    return problems
