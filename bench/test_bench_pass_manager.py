"""Trace + pass-manager throughput on GPT-style transformers of 12, 48 and 96 layers.

Reported as nodes per second, and as a ratio to a bare torch.fx.symbolic_trace of the same
model measured in the same run (the floor any fx-based pipeline pays).
"""
import time

import pytest
import torch

import graphopt
from graphopt.testing import zoo

from conftest import rounds

LAYERS = [12, 48, 96]


def _model(layers):
    torch.manual_seed(0)
    return zoo.gpt(batch=2, seq=32, layers=layers, dim=64, heads=4)


@pytest.mark.parametrize("layers", LAYERS)
def test_trace_and_default_pipeline(benchmark, quick, figures, layers):
    if quick and layers != LAYERS[0]:
        pytest.skip("quick mode runs the smallest size only")
    model, args, kwargs = _model(layers)

    start = time.perf_counter()
    torch.fx.symbolic_trace(model, concrete_args={"targets": None} if not kwargs else None)
    baseline_s = time.perf_counter() - start

    timings = []

    def run():
        start = time.perf_counter()
        opt = graphopt.optimize(model, args, example_kwargs=kwargs)
        timings.append(time.perf_counter() - start)
        return opt

    report = benchmark.pedantic(run, rounds=rounds(quick, 3), iterations=1).graphopt_report
    seconds = sorted(timings)[len(timings) // 2]
    info = dict(
        layers=layers,
        nodes=report.nodes,
        nodes_per_s=round(report.nodes / seconds),
        vs_bare_symbolic_trace=round(seconds / baseline_s, 1),
    )
    benchmark.extra_info.update(info, per_pass_ms={r.name: round(r.time_ms, 1) for r in report.passes})
    figures(**info)
    assert report.nodes > 20 * layers
