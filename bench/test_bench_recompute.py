"""Recompute under a memory budget, measured in one run against its baselines (recompute_figures.py).

- estimate vs measured peak of a training step, per zoo model;
- the pass at f = 0.3 / 0.5 / 0.7 on each zoo model: measured peak / budget, recompute share
  and step time against no recompute; on the GPT also against checkpointing every block by hand;
- the GPT at the hand-written plan's own measured peak: recompute FLOPs and step time against it;
- solver time against graph size.
Figures are printed at the end of the run (bench/conftest.py).
"""
import pytest

import recompute_figures as rf
from conftest import rounds


@pytest.mark.parametrize("name", rf.SIZES)
def test_estimate_error(benchmark, quick, figures, name):
    if quick and name != "mlp":
        pytest.skip("quick mode runs one model")
    figures(device=rf.DEVICE, **benchmark.pedantic(lambda: rf.estimate_error(name), rounds=1, iterations=1))


@pytest.mark.parametrize("f", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("name", rf.SIZES)
def test_recompute_budgets(benchmark, quick, figures, name, f):
    if quick and (f != 0.5 or name != "gpt"):
        pytest.skip("quick mode runs the GPT at f = 0.5")
    row = benchmark.pedantic(lambda: rf.budget_run(name, f, rounds(quick, 9)), rounds=1, iterations=1)
    figures(device=rf.DEVICE, **row)
    if row["result"] == "fits":
        assert row["measured_over_budget"] <= 1.0


def test_recompute_at_hand_checkpointing_memory(benchmark, quick, figures):
    if quick:
        pytest.skip("full mode only")
    figures(device=rf.DEVICE, **benchmark.pedantic(lambda: rf.at_hand_memory(9), rounds=1, iterations=1))


@pytest.mark.parametrize("nodes", [200, 1000, 2000, 5000])
def test_solver_time(benchmark, quick, figures, nodes):
    if quick and nodes != 200:
        pytest.skip("quick mode runs 200 nodes")
    seconds = benchmark.pedantic(lambda: rf.solver_time(nodes), rounds=rounds(quick, 3), iterations=1)
    figures(nodes=nodes, solve_s=round(seconds, 3))
