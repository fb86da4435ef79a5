"""The least budget graphopt plans for: what its BudgetError names at a budget of one byte."""
from __future__ import annotations

import math
import warnings

import graphopt


def least_bytes(model, args: tuple, kwargs: dict, **options) -> int:
    """Bytes of the least budget optimize() can plan model's step for (options: accumulate=...)."""
    try:
        graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=1e-9, **options)
    except graphopt.BudgetError as e:
        return e.min_budget_bytes
    raise AssertionError("a budget of 1 byte was met: the step holds no tensor")



def idle_budget_bytes(model, args: tuple, kwargs: dict, **options) -> int:
    """Bytes of the least budget at which optimize() recomputes nothing: its own predicted peak
    (after the default passes: below the traced graph's estimate where fuse runs) plus the headroom
    it keeps free on CUDA."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", graphopt.BudgetWarning)
        opt = graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=1e6, **options)
    fit = opt.graphopt_report.recompute().budget
    return math.ceil(fit.peak_before_bytes * fit.budget_bytes / fit.planned_for_bytes)
