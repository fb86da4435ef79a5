"""A new sequence length without a new plan: export keeps the lengths dynamic, a budget plan
made for the longest length serves the shorter ones (its estimate checked at each new length),
and the lazy form keeps a bounded set of graphs, building a new one only where none serves."""
import pytest
import torch

import graphopt
import graphopt.frontend.export_batch
import graphopt.runtime.lazy
from graphopt.analysis.memory import GB, estimate_peak, measure_step
from graphopt.testing import zoo
from graphopt.frontend.graph_inputs import placeholder_values

from conftest import assert_same_step, step


def _llama(length: int = 32):
    """A causal LM as transformers' users call it (labels=input_ids), traced by torch.export."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    return model, _batch(length)


def _batch(length: int, rows: int = 2):
    ids = torch.randint(0, 128, (rows, length))
    return (ids,), {"labels": ids}


def _halfway_budget(model, args, kwargs) -> float:
    """Halfway between the least budget a plan reaches and the unplanned step's peak."""
    plain = graphopt.optimize(model, args, example_kwargs=kwargs, passes="normalize,cse,dce")
    peak = estimate_peak(plain, placeholder_values(plain, args, kwargs)).peak_bytes / GB
    with pytest.raises(graphopt.BudgetError) as refused:
        graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=1e-9)
    return (refused.value.min_budget_gb + peak) / 2


def test_an_exported_lm_takes_other_lengths_with_the_labels_its_users_give():
    model, (args, kwargs) = _llama()
    opt = graphopt.optimize(model, args, example_kwargs=kwargs)
    assert "dim 1 of argument 1: 2 and up" in opt.graphopt_report.runs_at
    for length in (8, 20, 48):
        args2, kwargs2 = _batch(length)
        kwargs2 = {"labels": kwargs2["labels"].masked_fill(torch.rand(2, length) < 0.3, -100)}  # labels apart
        assert_same_step(model, opt, args2, kwargs2, exact=True)


def test_a_call_whose_sizes_export_related_disagree_is_refused_before_a_budget_estimate():
    model, (args, kwargs) = _llama()
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=_halfway_budget(model, args, kwargs))
    ids = torch.randint(0, 128, (2, 16))
    # each length in its range, the labels' not the ids': export's own check of the two, as a graphopt error
    with pytest.raises(graphopt.UsageError, match="Guard failed"):
        opt(ids, labels=torch.randint(0, 128, (2, 24)))


def test_an_example_of_one_row_keeps_its_batch_static_and_its_length_dynamic():
    model, _ = _llama()
    args, kwargs = _batch(32, rows=1)
    opt = graphopt.optimize(model, args, example_kwargs=kwargs)
    assert opt.graphopt_report.runs_at.startswith("dim 1 of argument 1: 2 and up")
    assert_same_step(model, opt, *_batch(12, rows=1), exact=True)
    # two rows, which the graph does not take: a graph of their own (runtime/batch_graphs.py)
    assert_same_step(model, opt, *_batch(12, rows=2), exact=True)
    assert list(opt.graphopt_batch_graphs.graphs) == [2]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_budget_plan_serves_shorter_lengths_within_the_budget_and_refuses_a_longer_one(frontend):
    model, args, kwargs = zoo.gpt(batch=2, seq=32, layers=2)
    budget = _halfway_budget(model, args, kwargs)
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=budget, frontend=frontend)
    assert opt.graphopt_report.recompute().stats["segments"] > 0
    for length in (24, 16):
        shorter = (args[0][:, :length].contiguous(),), {"targets": kwargs["targets"][:, :length].contiguous()}
        assert_same_step(model, opt, *shorter, exact=True)
        assert measure_step(opt, *shorter) <= budget * GB  # the promise, measured: CPU is deterministic
    longer = (args[0].repeat(1, 2),), {"targets": kwargs["targets"].repeat(1, 2)}
    with pytest.raises(graphopt.BudgetError, match=r"plan was made for other sizes: at int64\[2, 64\].* its step "
                                                   r"needs .* over the .* its plan for int64\[2, 32\]"):
        opt(*longer[0], **longer[1])


def test_the_lazy_form_plans_once_for_a_loader_whose_longest_batch_comes_first(monkeypatch):
    model, (args, kwargs) = _llama()
    budget = _halfway_budget(model, args, kwargs)
    lazy = graphopt.optimize(model, budget_gb=budget)
    builds = []
    build = lazy._build
    monkeypatch.setitem(lazy.__dict__, "_build", lambda *a, **k: builds.append(a[1][0].shape[1]) or build(*a, **k))
    for length in (32, 24, 8, 16, 28, 24):
        args2, kwargs2 = _batch(length)
        assert_same_step(model, lazy, args2, kwargs2, exact=True)
    assert builds == [32]
    exports = []
    export = graphopt.frontend.export_batch.export
    monkeypatch.setattr(graphopt.frontend.export_batch, "export", lambda *a: exports.append(a) or export(*a))
    for length in (40, 36, 8):  # longer than the plan's and over its budget: a plan of its own, then served
        args2, kwargs2 = _batch(length)
        assert_same_step(model, lazy, args2, kwargs2, exact=True)
    assert builds == [32, 40]
    assert not exports  # the program exported at 32 tokens takes 40: planned again, not exported again
    with pytest.raises(graphopt.BudgetError, match="below the"):  # no plan fits at twice the length
        lazy(*_batch(64)[0], **_batch(64)[1])


def test_the_lazy_form_keeps_at_most_max_graphs_the_least_recently_used_dropped(monkeypatch):
    monkeypatch.setattr(graphopt.runtime.lazy, "MAX_GRAPHS", 2)
    model, (x,), _ = zoo.mlp(batch=8)
    lazy = graphopt.optimize(model)
    lazy(x)
    first = lazy.graph_module
    lazy(x[:4])  # any batch: the same graph (torch.fx)
    assert lazy.graph_module is first and lazy._builds == 1
    lazy.eval()
    with torch.no_grad():
        lazy(x)  # the other mode: a graph of its own
    lazy.train()
    lazy(x.reshape(2, 4, -1))  # three dimensions: another kind of call, a third graph; the first is dropped
    assert lazy._builds == 3 and len(lazy._graphs) == 2
    assert first not in [g for g, _, _ in lazy._graphs.values()] and first not in lazy._built.values()
    assert_same_step(model, lazy, (x,), {}, exact=True)  # built again
    assert lazy._builds == 4 and len(lazy._graphs) == 2


def test_an_export_is_kept_for_the_sizes_it_takes_and_the_state_it_holds():
    model, (args, kwargs) = _llama()
    cache = graphopt.frontend.export_batch.ExportCache()
    with graphopt.frontend.export_batch.keeping_exports(cache):
        graphopt.trace(model, args, kwargs, frontend="export")
    assert cache.get(model, *_batch(16)) is not None
    assert cache.get(model, (torch.randint(0, 128, (2, 16)).int(),), {"labels": _batch(16)[1]["labels"]}) is None
    model.double()  # converted in place: the same Parameters, another dtype
    assert cache.get(model, *_batch(16)) is None


def test_a_budget_in_inference_serves_shorter_lengths_and_refuses_a_longer_one():
    model, args, _ = zoo.gpt(batch=2, seq=32, layers=2, targets=False)
    model.eval()
    plain = graphopt.optimize(model, args, passes="normalize,cse,dce")
    forward = estimate_peak(plain, placeholder_values(plain, args, {}), train=False).peak_bytes
    opt = graphopt.optimize(model, args, budget_gb=forward * 1.01 / GB)  # inference: the forward as it is
    with torch.no_grad():
        shorter = args[0][:, :16].contiguous()
        assert torch.equal(opt(shorter).logits, model(shorter).logits)
        with pytest.raises(graphopt.BudgetError, match="plan was made for other sizes"):
            opt(args[0].repeat(1, 2))


def test_a_bf16_plan_serves_a_shorter_length_as_the_bf16_graph_without_a_budget():
    model, (args, kwargs) = _llama()
    plain = graphopt.optimize(model, args, example_kwargs=kwargs, passes="normalize,cse,dce", precision="bf16")
    peak = estimate_peak(plain, placeholder_values(plain, args, kwargs)).peak_bytes / GB
    with pytest.raises(graphopt.BudgetError) as refused:
        graphopt.optimize(model, args, example_kwargs=kwargs, precision="bf16", budget_gb=1e-9)
    planned = graphopt.optimize(model, args, example_kwargs=kwargs, precision="bf16",
                                budget_gb=(refused.value.min_budget_gb + peak) / 2)
    assert planned.graphopt_report.recompute().stats["segments"] > 0
    ids = torch.randint(0, 128, (2, 20))
    labels = torch.randint(0, 128, (2, 20)).masked_fill(torch.rand(2, 20) < 0.3, -100)  # apart from the ids
    want, got = step(plain, (ids,), {"labels": labels}), step(planned, (ids,), {"labels": labels})
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0]))
    assert want[1].keys() == got[1].keys() and all(torch.equal(want[1][k], got[1][k]) for k in want[1])


class _LearnedPositions(torch.nn.Module):
    """GPT-2's way: a learned position table looked up by arange(T), which export proves no bound for."""

    def __init__(self, positions: int = 16, offset: int = 0):
        super().__init__()
        self.tok = torch.nn.Embedding(32, 8)
        self.pos = torch.nn.Embedding(positions, 8)
        self.head = torch.nn.Linear(8, 32)
        self.offset = offset

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]) + self.offset
        h = self.tok(ids) + self.pos(positions)[None]
        return self.head(h).logsumexp(-1).mean()


@pytest.mark.parametrize("offset", [0, 2])
def test_a_length_past_the_models_position_table_is_a_size_error_naming_it(offset):
    torch.manual_seed(0)
    model, longest = _LearnedPositions(offset=offset), 16 - offset
    opt = graphopt.optimize(model, (torch.randint(0, 32, (2, 8)),), frontend="export")
    assert f"dim 1 of argument 1: 2 to {longest} (pos.weight has 16 rows, looked up by position)" \
        in opt.graphopt_report.runs_at
    assert_same_step(model, opt, (torch.randint(0, 32, (3, longest)),), {})
    with pytest.raises(IndexError):  # eager's error, and graphopt's is one too
        model(torch.randint(0, 32, (2, longest + 1)))
    with pytest.raises(graphopt.SizeError, match=f"is {longest + 1}, past the model's own limit of {longest}: "
                       "pos.weight has 16 rows.*at most"):
        opt(torch.randint(0, 32, (2, longest + 1)))
    for lazy in (False, True):  # the example itself past it: no graph is built
        with pytest.raises(graphopt.SizeError, match="the example's sequence length is 20, past"):
            ids = torch.randint(0, 32, (2, 20))
            graphopt.optimize(model, frontend="export")(ids) if lazy else \
                graphopt.optimize(model, (ids,), frontend="export")
