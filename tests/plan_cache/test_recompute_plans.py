"""A budget's plan made in one process is taken from the plan cache by the next: the same graph,
the same step to the bit, no search; anything the plan reads changed, and it is planned again."""
import functools
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

import graphopt
import graphopt.plan_cache.key
from graphopt.passes.recompute.recompute_pass import Recompute
from graphopt.plan_cache.store import PlanStore
from graphopt.testing import zoo

from conftest import step


def _gpt(seq=64):
    torch.manual_seed(0)
    return zoo.gpt(batch=4, seq=seq, layers=2, dim=64)


@functools.lru_cache(maxsize=1)
def _budget() -> float:
    """Halfway from the least budget to the unplanned peak of _gpt()'s step (the same model each time)."""
    return _halfway(*_gpt())


@functools.lru_cache(maxsize=1)
def _cold() -> tuple[str, str, str]:
    """The entry _gpt()'s plan at _budget() leaves (its file name and text), and the graph's code:
    made once, copied into each test's own cache."""
    model, args, kwargs = _gpt()
    with tempfile.TemporaryDirectory() as directory:
        opt = graphopt.optimize(model, args, kwargs, budget_gb=_budget(), plan_cache=directory)
        (path,) = PlanStore(directory).dir.glob("*.json")
        return path.name, path.read_text(), opt.code


def _planned_before(tmp_path, text: str | None = None):
    """tmp_path as a cache holding _cold()'s entry (or `text` in its place)."""
    name, cold, _ = _cold()
    store = PlanStore(tmp_path)
    store.dir.mkdir(parents=True)
    (store.dir / name).write_text(cold if text is None else text)
    return store.dir / name


def _halfway(model, args, kwargs) -> float:
    with pytest.raises(graphopt.BudgetError) as refused:
        graphopt.optimize(model, args, kwargs, budget_gb=1e-9, plan_cache=False)
    plain = graphopt.measure_step(model, args, kwargs)
    return (refused.value.min_budget_gb + plain.peak_gb) / 2


def _cache_state(opt) -> str:
    return opt.graphopt_report.passes[-1].stats["plan_cache"]


def _forbid_planning(monkeypatch):
    """From here on, planning raises: what runs must come from the cache."""
    def refuse(self, gm, ctx):
        raise AssertionError("planned, not replayed")
    monkeypatch.setattr(Recompute, "_plan", refuse)


def test_a_second_optimize_replays_the_plan_to_the_same_graph_and_step(tmp_path, monkeypatch):
    model, args, kwargs = _gpt()
    budget = _budget()
    cold = graphopt.optimize(model, args, kwargs, budget_gb=budget, plan_cache=tmp_path)
    assert _cache_state(cold) == "planned and kept" and len(PlanStore(tmp_path)) == 1
    record = cold.graphopt_report.passes[-1]
    assert record.stats["segments"] and record.stats["written_in_place"]  # both replayed below
    _forbid_planning(monkeypatch)
    warm = graphopt.optimize(model, args, kwargs, budget_gb=budget, plan_cache=tmp_path)
    assert _cache_state(warm) == "from the cache"
    assert "the plan from the plan cache" in warm.graphopt_report.headline()
    assert warm.code == cold.code
    segments = [[(n.target.module.code, n.target.selective) for n in m.graph.nodes if hasattr(n.target, "draws")]
                for m in (cold, warm)]
    assert segments[0] == segments[1] and segments[0]
    again = warm.graphopt_report.passes[-1]
    assert (again.budget, again.peak_bytes) == (record.budget, record.peak_bytes)
    assert {k: v for k, v in again.stats.items() if k != "plan_cache"} == \
        {k: v for k, v in record.stats.items() if k != "plan_cache"}
    for batch in ((args, kwargs), _gpt()[1:]):  # the example and a second batch
        (out_c, grads_c), (out_w, grads_w) = step(cold, *batch), step(warm, *batch)
        assert all(torch.equal(a, b) for a, b in zip(out_c, out_w))
        assert all(torch.equal(grads_c[k], grads_w[k]) for k in grads_c)
    assert graphopt.measure_step(warm, args, kwargs).peak_bytes == graphopt.measure_step(cold, args, kwargs).peak_bytes


def test_a_refusal_is_replayed_as_the_same_budget_error(tmp_path, monkeypatch):
    model, args, kwargs = _gpt()
    with pytest.raises(graphopt.BudgetError) as cold:
        graphopt.optimize(model, args, kwargs, budget_gb=1e-6, plan_cache=tmp_path)
    _forbid_planning(monkeypatch)
    with pytest.raises(graphopt.BudgetError) as warm:
        graphopt.optimize(model, args, kwargs, budget_gb=1e-6, plan_cache=tmp_path)
    assert str(warm.value) == str(cold.value)
    assert (warm.value.min_budget_bytes, warm.value.breakdown, warm.value.headroom) == \
        (cold.value.min_budget_bytes, cold.value.breakdown, cold.value.headroom)


def _relu_block(model):
    """The first block's MLP with a ReLU where the GELU was: other code, the same parameters."""
    block = model.blocks[0]
    gelu = torch.nn.functional.gelu

    def forward(x):
        torch.nn.functional.gelu = lambda h, approximate="none": torch.relu(h)
        try:
            return type(block).forward(block, x)
        finally:
            torch.nn.functional.gelu = gelu
    block.forward = forward
    return model


def _frozen(model):
    model.blocks[0].fc.weight.requires_grad_(False)
    return model


def _dropout(model):
    model.blocks[1].dropout = 0.2
    return model


CHANGES = {
    "budget": lambda m, a, k, b: (m, a, k, {"budget_gb": b * 1.1}),
    "optimizer": lambda m, a, k, b: (m, a, k, {"budget_gb": b * 2, "optimizer": "adamw"}),
    "accumulate": lambda m, a, k, b: (m, a, k, {"budget_gb": b * 1.5, "accumulate": True}),
    "input length": lambda m, a, k, b: (m, (a[0][:, :48].clone(),), {"targets": k["targets"][:, :48].clone()},
                                        {"budget_gb": b}),
    "a frozen parameter": lambda m, a, k, b: (_frozen(m), a, k, {"budget_gb": b}),
    "the model's code": lambda m, a, k, b: (_relu_block(m), a, k, {"budget_gb": b}),
    "the model's config": lambda m, a, k, b: (_dropout(m), a, k, {"budget_gb": b}),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_anything_the_plan_reads_changed_plans_again(tmp_path, change):
    model, args, kwargs = _gpt()
    budget = _budget()
    _planned_before(tmp_path)
    model, args, kwargs, options = CHANGES[change](model, args, kwargs, budget)
    opt = graphopt.optimize(model, args, kwargs, plan_cache=tmp_path, **options)
    assert _cache_state(opt) == "planned and kept" and len(PlanStore(tmp_path)) == 2


@pytest.mark.parametrize("version", ["torch", "graphopt"])
def test_other_versions_plan_again(tmp_path, monkeypatch, version):
    model, args, kwargs = _gpt()
    budget = _budget()
    _planned_before(tmp_path)
    assert _cache_state(graphopt.optimize(model, args, kwargs, budget_gb=budget, plan_cache=tmp_path)) == \
        "from the cache"  # the entry copied in is this model's
    if version == "torch":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    else:
        monkeypatch.setattr(graphopt.plan_cache.key, "source_digest", lambda: "other code")
    assert _cache_state(graphopt.optimize(model, args, kwargs, budget_gb=budget, plan_cache=tmp_path)) == \
        "planned and kept"


def _tamper(payload: dict, how: str) -> None:
    if how == "other nodes":
        payload["names"] = "0" + payload["names"]
    elif how == "overlapping segments":
        payload["segments"] = [[0, len(payload["decisions"]), False]] + payload["segments"]
    elif how == "segments past the graph":
        payload["segments"][-1][1] = payload["count"] + 5
    elif how == "writes of another kind":
        payload["stats"]["written_in_place"] = ["add"]
    elif how == "an optimizer the settings do not have":
        payload["optimizer"] = [1, 2]


@pytest.mark.parametrize("how", ["other nodes", "overlapping segments", "segments past the graph",
                                 "writes of another kind", "an optimizer the settings do not have"])
def test_an_entry_that_does_not_match_the_graph_is_planned_again(tmp_path, how):
    """An entry as another graph, another version or a hand in the shared directory left it: a miss,
    the graph planned as traced, never a crash or a plan applied to the wrong nodes."""
    model, args, kwargs = _gpt()
    entry = json.loads(_cold()[1])
    _tamper(entry["payload"], how)
    _planned_before(tmp_path, json.dumps(entry))
    warm = graphopt.optimize(model, args, kwargs, budget_gb=_budget(), plan_cache=tmp_path)
    assert _cache_state(warm) == "planned and kept" and warm.code == _cold()[2]


def test_train_step_takes_its_plans_and_refusals_from_the_cache(tmp_path, monkeypatch):
    model, args, kwargs = _gpt()
    least = _budget()  # halfway for the whole batch: fits at 2 microbatches or fewer
    first = graphopt.train_step(model, args, kwargs, budget_gb=least * 0.8, plan_cache=tmp_path)
    _forbid_planning(monkeypatch)
    second = graphopt.train_step(model, args, kwargs, budget_gb=least * 0.8, plan_cache=tmp_path)
    assert second.microbatches == first.microbatches


_START = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("ignore")
    import torch, graphopt
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                        for _ in range(4))

        def forward(self, x):
            with torch.no_grad():  # torch.export keeps this region as a higher-order op and its subgraph
                scale = x.abs().mean(-1, keepdim=True) + 1
            x = x / scale
            for block in self.blocks:
                x = x + block(x)
            return x.square().mean()

    torch.manual_seed(0)
    model, x = Model(), torch.randn(16, 32, 64)
    opt = graphopt.optimize(model, (x,), frontend="export", budget_gb=0.0045, plan_cache=sys.argv[1])
    print(opt.graphopt_report.recompute().stats["plan_cache"])
""")


@pytest.mark.slow  # two fresh processes: make test-real
def test_a_second_process_takes_the_plan_the_first_made(tmp_path):
    """A training script's second start: torch.export's graph (a higher-order op and its subgraph
    included) keys the same in another process."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    starts = [subprocess.run([sys.executable, "-c", _START, str(tmp_path)], capture_output=True, text=True,
                             cwd=root, check=True).stdout.split("\n")[-2] for _ in range(2)]
    assert starts == ["planned and kept", "from the cache"]
