"""The memory promise on the real-model corpus (tests/corpus/memory.py), at a batch where
activations outweigh parameters: the predicted peak of the user's step is within 3% of the
measured one (never under by more than 1%) without recompute and at every plan; a plan at
f = 0.3, 0.5, 0.7 of the activations measures within its budget or is refused with a least
budget above it, 1% above which a plan measures within its budget (the first refusal's least,
once per model); and the budget the model's own checkpointing meets is never refused, and at
it graphopt's step runs no more matmul and convolution FLOPs than own's (where the sweep
measured it: the auto frontend).

`make test-real` holds the promise on every model, through the export frontend too where the auto
frontend picks fx (where it picks export, the auto run is the export one); `make test` runs the
GPT-2 and LSTM cases below.
"""
import pytest
import torch

import graphopt
from corpus import CORPUS
from corpus.memory import memory_case, memory_points, point_problems

pytestmark = pytest.mark.realmodels


def pytest_generate_tests(metafunc):
    all_ = metafunc.config.getoption("--corpus") == "all"
    if "memory_frontend" in metafunc.fixturenames:
        metafunc.parametrize("memory_frontend", ["auto", "export"] if all_ else ["auto"])
    if "memory_model" in metafunc.fixturenames:
        metafunc.parametrize("memory_model", list(CORPUS) if all_ else [])


def _promise(name: str, frontend: str = "auto") -> None:
    points = memory_points(memory_case(name), frontend=frontend, flops=frontend == "auto")
    problems = [p for point in points for p in point_problems(point)]
    assert not problems, problems


def test_memory_promise_holds(memory_model, memory_frontend):
    if memory_frontend == "export":
        case = memory_case(memory_model)
        if graphopt.trace(case.model, case.args, case.kwargs).meta["graphopt_frontend"] == "export":
            pytest.skip("the auto frontend traces it with export: the auto run is this one, FLOPs included")
    _promise(memory_model, memory_frontend)


# The cases the memory issue was filed with, each of which once overshot its budget silently:
# GPT-2 at 60% of its eager peak with fuse (1.60x), fuse + inplace + bf16 (1.70x) and inplace
# (1.045x); an nn.LSTM at 40% (2.5x: its workspace was invisible).
GPT2_PASSES = [("fuse", None), ("fuse,inplace", "bf16"), ("inplace", None)]


@pytest.mark.parametrize("passes, precision", GPT2_PASSES, ids=["fuse", "fuse-inplace-bf16", "inplace"])
def test_gpt2_with_other_passes_holds_its_budget(passes, precision, monkeypatch):
    # Fused groups on CPU run their torch reference, as a CPU user's would: Triton's
    # interpreter (CI's way to test the codegen) holds a kernel's arguments a while longer
    # than a GPU launch does, which no estimate of the product should count.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from corpus.memory import user_step_peak
    from graphopt.analysis.memory import GB

    case = memory_case("hf_gpt2")
    budget = 0.6 * user_step_peak(case.model, case)

    def plan(budget):
        return graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, budget_gb=budget / GB,
                                 passes=f"normalize,cse,dce,{passes}", precision=precision)

    try:
        opt = plan(budget)
    except graphopt.BudgetError as e:
        assert e.min_budget_gb * GB > budget
        budget = 1.01 * e.min_budget_gb * GB  # the least it names is a budget it meets
        opt = plan(budget)
    assert user_step_peak(opt, case) <= budget


class _LSTMRegressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(64, 128, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(128, 1)

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.head(y).square().mean()


@pytest.mark.parametrize("f", [0.4, 1.0])
def test_an_lstm_holds_its_budget_or_says_it_cannot(f):
    from graphopt.analysis.memory import GB, estimate_peak, measure_step

    torch.manual_seed(0)
    model, x = _LSTMRegressor(), torch.randn(8, 50, 64)
    eager = measure_step(model, (x,))
    plain = graphopt.trace(model, (x,))
    assert estimate_peak(plain, [x]).peak_bytes == pytest.approx(eager, rel=0.01)  # the workspace is counted
    budget = f * eager
    try:
        opt = graphopt.optimize(model, (x,), budget_gb=budget / GB)
    except graphopt.BudgetError as e:
        assert f < 1 and e.min_budget_gb * GB > budget
        budget = 1.01 * e.min_budget_gb * GB  # the least it names is a budget it meets
        opt = graphopt.optimize(model, (x,), budget_gb=budget / GB)
    assert measure_step(opt, (x,)) <= budget


@pytest.mark.slow
def test_roberta_holds_its_least_budget():
    # RoBERTa's position ids: `.long()` of an int32 count, then `+ padding_idx` written in place.
    # At its least budget a segment starts at that cast, and the segments' check once took the
    # cast's copy for the int32 count it reads, made outside the segment: the pass failed.
    from corpus.memory import optimized_point

    case = memory_case("hf_roberta")
    refused, _ = optimized_point(case, "none", 1)
    point, opt = optimized_point(case, "least", refused.least)
    assert opt is not None and not point_problems(point), point
