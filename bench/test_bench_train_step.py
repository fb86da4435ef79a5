"""graphopt.train_step at a tight budget against halving the batch on OOM, measured in one run.

The budget is 85% of the least graphopt.optimize can plan for the full batch: the full batch
does not fit, whatever is recomputed. Three ways to train at it:

- train_step: the fewest equal microbatches whose planned step fits, gradients accumulated;
  the global batch is kept.
- halving, eager (Accelerate's find_executable_batch_size): start at the full batch, and while
  a step measures over the budget (the OOM, simulated on CPU), halve the batch and retry; no
  accumulation, so the global batch shrinks.
- halving, graphopt: the same, each try optimize(budget_gb=...) at that batch, halved on its
  BudgetError or a measured overshoot.

Figures: retries, rows per step and whether the global batch is kept, measured peak / budget,
and step time (and time per row) against eager's full-batch step measured in the same run
(runtime/step.step_seconds). Ratios only: no time is asserted.
"""
import torch

import graphopt
from graphopt.analysis.memory import GB, measure_peak
from graphopt.runtime.step import clear_grads, run_step, step_peak, step_seconds
from graphopt.testing import zoo

from conftest import rounds
from least_budget import least_bytes

SIZES = {True: dict(batch=8, seq=32, layers=2, dim=32, heads=2, vocab=128),
         False: dict(batch=16, seq=64, layers=4, dim=64, heads=4, vocab=256)}
TIGHT = 0.85


def _first_rows(args, kwargs, rows):
    """The first `rows` of the batch, as a halving loop cuts its dataloader's batch."""
    cut = lambda v: v[:rows] if isinstance(v, torch.Tensor) and v.dim() else v  # noqa: E731
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _halving(model, args, kwargs, budget, graph: bool):
    """(module, args, kwargs, retries, peak) of find_executable_batch_size at `budget`: halve the
    batch while a try is refused (BudgetError) or measures over the budget."""
    rows, retries = int(args[0].shape[0]), 0
    while rows >= 1:
        a, kw = _first_rows(args, kwargs, rows)
        try:
            module = graphopt.optimize(model, a, example_kwargs=kw, budget_gb=budget / GB) if graph else model
            peak = step_peak(module, model, a, kw)
            if peak <= budget:
                return module, a, kw, retries, peak
        except graphopt.BudgetError:
            pass
        rows, retries = rows // 2, retries + 1
    return None, None, None, retries, None


def _measured(fn, model, args, kwargs) -> int:
    clear_grads(model)
    try:
        return measure_peak(fn, model, *args, *kwargs.values())
    finally:
        clear_grads(model)


def _step(fn, model):
    def run():
        clear_grads(model)
        fn()
    return run


def compare(quick: bool) -> dict:
    torch.manual_seed(0)
    model, args, kwargs = zoo.gpt(**SIZES[quick])
    full = int(args[0].shape[0])
    budget = TIGHT * least_bytes(model, args, kwargs)
    step = graphopt.train_step(model, args, kwargs, budget_gb=budget / GB)
    step_peak_ = _measured(lambda: step(*args, **kwargs), model, args, kwargs)
    runs = {"eager full batch": _step(lambda: run_step(model, args, kwargs), model),
            "train_step": _step(lambda: step(*args, **kwargs), model)}
    row = {"budget_mb": round(budget / 1e6, 2), "full_rows": full,
           "train_step": {"microbatches": step.microbatches, "retries": 0, "rows": full, "kept": True,
                          "peak_over_budget": round(step_peak_ / budget, 3)}}
    for name, graph in (("halving eager", False), ("halving graphopt", True)):
        module, a, kw, retries, peak = _halving(model, args, kwargs, budget, graph)
        kept = a is not None and int(a[0].shape[0])
        row[name] = {"retries": retries, "rows": kept or 0, "kept": kept == full,
                     "peak_over_budget": round(peak / budget, 3) if peak else None}
        if module is not None:
            runs[name] = _step(lambda m=module, a=a, kw=kw: run_step(m, a, kw), model)
    seconds = step_seconds(runs, repeats=rounds(quick, 7))
    eager = seconds.pop("eager full batch")
    for name, s in seconds.items():
        row[name]["time_vs_eager"] = round(s / eager, 2)
        row[name]["time_per_row_vs_eager"] = round(s / row[name]["rows"] * full / eager, 2)
    clear_grads(model)
    return row


def test_train_step_against_halving_on_oom(benchmark, quick, figures):
    row = benchmark.pedantic(lambda: compare(quick), rounds=1, iterations=1)
    figures(**{k: v for k, v in row.items() if not isinstance(v, dict)})
    for name in ("train_step", "halving eager", "halving graphopt"):
        figures(way=name, **row[name])
    ours = row["train_step"]
    assert ours["microbatches"] > 1 and ours["kept"] and ours["peak_over_budget"] <= 1.0
    for name in ("halving eager", "halving graphopt"):  # the full batch is over budget for both
        assert row[name]["retries"] >= 1 and not row[name]["kept"]
        assert row[name]["peak_over_budget"] is None or row[name]["peak_over_budget"] <= 1.0
