"""`graphopt.check_estimate`: the step's memory estimate, which every budget is planned by, held
against the same step run for real, and the first place the two part named
(analysis/estimate_check.py does the comparing). What to run when a step measures over its budget,
or calibrate keeps planning again."""
from __future__ import annotations

import torch
import torch.fx

from ..analysis.estimate_check import EstimateCheck, check_estimate as _check
from ..analysis.optimizer_memory import check_optimizer, optimizer_memory
from ..errors import UsageError
from ..frontend.graph_inputs import placeholder_values
from ..frontend.input_aliases import distinct
from ..frontend.trace import check_inputs, trace


def check_estimate(module: torch.nn.Module, example_inputs, example_kwargs: dict | None = None, *,
                   optimizer=None, accumulate: bool = False, frontend: str = "auto") -> EstimateCheck:
    """One training step of `module` on the example (forward, the loss the model returns,
    backward), estimated on FakeTensors as budget_gb plans it and run for real in the same
    instrument (live tensor storages, on CPU), storage by storage.

    module: your model (traced as graphopt.optimize traces it, with `frontend`), or a graph
    graphopt.optimize returned (its rewrite is what runs). optimizer (a torch.optim.Optimizer, or
    "adamw", "adam", "sgd", "momentum") and accumulate: as the recompute pass's options. The
    model's gradients, buffers, RNG and inputs are left as they were.

        check = graphopt.check_estimate(model, (x,), {"labels": y})
        check.predicted_bytes, check.measured_bytes, check.error, check.divergence
        print(check)   # "predicted 2.38 MB, measured 2.38 MB (+0.0%); every storage agrees"
    """
    if not isinstance(module, torch.nn.Module):
        raise UsageError(f"check_estimate needs a torch.nn.Module (the model, or what graphopt.optimize returned), "
                         f"got {type(module).__name__}.")
    if type(module).__name__ == "LazyOptimized":
        raise UsageError("check_estimate needs a graph: graphopt.optimize(model) without example inputs builds one "
                         "per call; give check_estimate the model itself, or optimize it with example inputs.")
    try:
        optimizer = check_optimizer(optimizer)
    except ValueError as e:
        raise UsageError(f"check_estimate's optimizer {e}.") from None
    args, kwargs = check_inputs(module, example_inputs, example_kwargs)
    if isinstance(module, torch.fx.GraphModule) and hasattr(module, "graphopt_report"):
        gm = module
    else:
        gm = trace(module, args, kwargs, frontend=frontend)
    train = module.training
    memory = optimizer_memory(optimizer, list(gm.parameters())) if optimizer is not None and train else None
    args, kwargs = distinct(args, kwargs)
    return _check(gm, placeholder_values(gm, args, kwargs), (args, kwargs), train=train, optimizer=memory,
                  accumulate=accumulate)
