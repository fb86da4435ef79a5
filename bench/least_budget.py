"""The least budget graphopt plans for: what its BudgetError names at a budget of one byte."""
from __future__ import annotations

import warnings

import graphopt
from graphopt.analysis.memory import GB


def least_bytes(model, args: tuple, kwargs: dict, **options) -> int:
    """Bytes of the least budget optimize() can plan model's step for (options: accumulate=...)."""
    try:
        graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=1e-9, **options)
    except graphopt.BudgetError as e:
        return round(e.min_budget_gb * GB)
    raise AssertionError("a budget of 1 byte was met: the step holds no tensor")


def planned_peak_bytes(model, args: tuple, kwargs: dict, **options) -> int:
    """Bytes of the step's peak as optimize() plans it with nothing to recompute: after the default
    passes (fuse, in-place), below the traced graph's estimate on a GPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", graphopt.BudgetWarning)
        opt = graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=1e6, **options)
    return opt.graphopt_report.recompute().stats["predicted_peak_bytes"]
