"""Recompute under a memory budget, measured in one run against its baselines.

- estimate vs measured peak of a CPU training step, per zoo model;
- the recompute pass at f = 0.3 / 0.5 / 0.7 (budget = parameters + gradients + f x the rest)
  on the GPT: measured peak / budget, recompute FLOPs and step time, next to no recompute
  and to hand-written torch.utils.checkpoint on every block;
- solver time against graph size.
Figures are printed at the end of the run (bench/conftest.py).
"""
import random
import time

import pytest

import graphopt
from graphopt import ops, zoo
from graphopt.checkpointing import checkpoint_segments
from graphopt.memory import GB, budget_at, estimate_peak, measure_step
from graphopt.solver import make_atoms, solve
from graphopt.trace import placeholder_values

from conftest import rounds

MODELS = {
    "mlp": lambda: zoo.mlp(batch=512, width=256, depth=4),
    "convnet": lambda: zoo.convnet(batch=16, size=32),
    "gpt": lambda: zoo.gpt(batch=8, seq=64, layers=4),
}


@pytest.mark.parametrize("name", MODELS)
def test_estimate_error(benchmark, quick, figures, name):
    if quick and name != "mlp":
        pytest.skip("quick mode runs one model")
    model, args, kwargs = MODELS[name]()
    gm = graphopt.trace(model, args, kwargs)
    flat = placeholder_values(gm, args, kwargs)
    estimate = benchmark.pedantic(lambda: estimate_peak(gm, flat), rounds=rounds(quick, 3), iterations=1)
    measured = measure_step(gm, args, kwargs)
    figures(estimate_mb=round(estimate.peak_bytes / 1e6, 2), measured_mb=round(measured / 1e6, 2),
            error_pct=round(100 * (estimate.peak_bytes - measured) / measured, 1))


def _step_seconds(module, args, kwargs, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        module(*args, **kwargs).loss.backward()
        times.append(time.perf_counter() - start)
        for p in module.parameters():
            p.grad = None
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("f", [0.3, 0.5, 0.7])
def test_recompute_against_hand_checkpointing(benchmark, quick, figures, f):
    if quick and f != 0.5:
        pytest.skip("quick mode runs f = 0.5")
    layers = 2 if quick else 4
    model, args, kwargs = zoo.gpt(batch=8, seq=64, layers=layers)
    plain = graphopt.trace(model, args, kwargs)
    budget_gb = budget_at(estimate_peak(plain, placeholder_values(plain, args, kwargs)), f)
    hand = graphopt.trace(model, args, kwargs)
    blocks = zoo.block_segments(hand)
    hand_flops = sum(ops.flops(n, hand) for block in blocks for n in block)
    checkpoint_segments(hand, blocks)
    try:
        opt = graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=budget_gb)
    except graphopt.BudgetError as err:
        figures(f=f, budget_mb=round(budget_gb * 1e3, 2), result="BudgetError",
                min_budget_mb=round(err.min_budget_gb * 1e3, 2))
        return
    stats = opt.graphopt_report.passes[-1].stats
    n = rounds(quick, 15)
    base = _step_seconds(plain, args, kwargs, n)
    hand_s = _step_seconds(hand, args, kwargs, n)
    graphopt_s = benchmark.pedantic(lambda: _step_seconds(opt, args, kwargs, n), rounds=1, iterations=1)
    figures(
        f=f, budget_mb=round(budget_gb * 1e3, 2),
        measured_over_budget=round(measure_step(opt, args, kwargs) / (budget_gb * GB), 2),
        hand_measured_over_budget=round(measure_step(hand, args, kwargs) / (budget_gb * GB), 2),
        recompute_cost_over_hand=round(stats["recompute_cost"] / hand_flops, 3),
        step_time_vs_no_recompute=round(graphopt_s / base, 2),
        hand_step_time_vs_no_recompute=round(hand_s / base, 2),
    )


@pytest.mark.parametrize("nodes", [200, 1000, 2000, 5000])
def test_solver_time(benchmark, quick, figures, nodes):
    if quick and nodes != 200:
        pytest.skip("quick mode runs 200 nodes")
    rng = random.Random(nodes)
    kept = [rng.randint(0, 1 << 20) for _ in range(nodes)]
    live = [rng.randint(1 << 18, 1 << 22) for _ in range(nodes)]
    flops = [rng.randint(1, 1 << 30) for _ in range(nodes)]
    ok = [rng.random() > 0.02 for _ in range(nodes)]
    keeps = [rng.random() < 0.2 for _ in range(nodes)]
    sel = [rng.randint(0, 1 << 20) if k else 0 for k in keeps]
    sel_cost = [f if k else 0 for f, k in zip(flops, keeps)]

    def plan():
        start = time.perf_counter()
        solve(make_atoms(kept, live, flops, ok, sel, sel_cost), sum(kept) // 2)
        return time.perf_counter() - start

    seconds = benchmark.pedantic(plan, rounds=rounds(quick, 3), iterations=1)
    figures(nodes=nodes, solve_s=round(seconds, 3))
