"""A trace for every model that runs eagerly, at every batch its loader gives: export tries fewer
dynamic sizes where it fails with them, and a graph whose batch went static builds a graph for
another batch size instead of refusing it (runtime/batch_graphs.py)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.analysis.memory import GB
from graphopt.runtime.guards import refusal

from conftest import assert_same_step


class Contrastive(nn.Module):
    """Two towers and CLIP's loss: its targets are torch.arange(len(logits)), which makes export
    take the batch as a constant."""

    def __init__(self):
        super().__init__()
        self.text, self.image = nn.Linear(8, 16), nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 16))

    def forward(self, text, image):
        t, i = F.normalize(self.text(text), dim=-1), F.normalize(self.image(image), dim=-1)
        logits = t @ i.T * 10.0
        targets = torch.arange(len(logits))
        return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2


def _batch(rows):
    return torch.randn(rows, 8), torch.randn(rows, 12)


def test_a_static_batch_builds_a_graph_for_each_other_batch_size_and_keeps_a_bounded_number():
    model = Contrastive()
    opt = graphopt.optimize(model, _batch(8), frontend="export")
    assert opt.meta["graphopt_batch"] is None and "depends on its size" in opt.graphopt_report.runs_at
    assert "a graph built for it at its first call" in opt.graphopt_report.runs_at
    graphs = opt.graphopt_batch_graphs
    graphs.limit = 2
    for rows in (8, 5, 3, 5, 2):  # a loader's last, smaller batch; then others
        batch = _batch(rows)
        assert_same_step(model, opt, batch, {}, exact=True)
    assert list(graphs.graphs) == [5, 2]  # 3, the least recently used, dropped
    assert all(g.meta["graphopt_batch"] is None for g in graphs.graphs.values())


def test_another_batch_under_a_budget_is_planned_for_or_refused_with_the_budget_reason():
    model = Contrastive()
    opt = graphopt.optimize(model, _batch(64), budget_gb=graphopt.measure_step(model, _batch(64)).peak_gb * 0.99,
                            frontend="export")
    assert_same_step(model, opt, _batch(32), {}, exact=True)  # smaller: planned for on its own
    with pytest.raises(graphopt.BudgetError, match="one of 4096 needs a graph of its own, which could not be built"):
        opt(*_batch(4096))


def test_a_call_that_differs_in_more_than_the_batch_is_refused_as_before():
    model = Contrastive()
    opt = graphopt.optimize(model, _batch(8), frontend="export")
    with pytest.raises(graphopt.UsageError, match="this graphopt module was built for inputs"):
        opt(torch.randn(4, 8), torch.randn(4, 13))
    assert not opt.graphopt_batch_graphs.graphs


def test_an_fx_graph_takes_every_batch_itself():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    fx = graphopt.optimize(model, (torch.randn(8, 8),), frontend="fx")
    x = torch.randn(3, 8)
    assert refusal(fx, (x,), {}) is None
    assert torch.equal(fx(x), model(x))
    assert not fx.graphopt_batch_graphs.graphs


class Sampled(nn.Module):
    """A VAE's reparameterization as diffusers writes it: torch.randn(shape, generator=None)."""

    def __init__(self):
        super().__init__()
        self.encode, self.decode = nn.Linear(6, 8), nn.Linear(4, 6)

    def forward(self, x):
        mean, logvar = self.encode(x).chunk(2, dim=1)
        z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=None, dtype=x.dtype)
        return F.mse_loss(self.decode(z), x) + 1e-3 * (mean.pow(2) + logvar.exp() - logvar).mean()


def test_sampling_with_generator_none_exports_with_a_dynamic_batch_and_leaves_the_inputs_unmarked():
    model, x = Sampled(), torch.randn(4, 6)
    opt = graphopt.optimize(model, (x,), frontend="export")
    assert str(opt.meta["graphopt_batch"]) == "batch 2 and up"
    assert not [k for k in vars(x) if k.startswith("_dynamo") or "dynamo" in k]  # export's marks taken off
    for rows in (4, 7):
        other = torch.randn(rows, 6)
        torch.manual_seed(0)
        want = model(other)
        torch.manual_seed(0)
        assert torch.equal(opt(other), want)


@torch.library.custom_op("graphopt_test::rows_concrete", mutates_args=())
def _rows_concrete(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_rows_concrete.register_fake
def _(x):
    if not isinstance(x.shape[0], int):  # a library whose fake kernel takes concrete sizes only
        raise RuntimeError("rows_concrete: symbolic sizes are not supported")
    return torch.empty_like(x)


_rows_concrete.register_autograd(lambda ctx, g: 2 * g)


class ConcreteRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        return torch.ops.graphopt_test.rows_concrete(self.linear(x)).sum()


def test_export_failing_with_a_dynamic_batch_for_any_reason_falls_back_to_a_static_one_and_says_why():
    model, x = ConcreteRows(), torch.randn(4, 3, 6)  # 3-d: its lengths are tried dynamic too
    opt = graphopt.optimize(model, (x,), frontend="export")
    runs_at = opt.graphopt_report.runs_at
    assert opt.meta["graphopt_batch"] is None
    assert "export with the batch and the lengths dynamic failed: rows_concrete: symbolic sizes" in runs_at
    assert "export with the batch dynamic failed" in runs_at
    assert_same_step(model, opt, (torch.randn(3, 3, 6),), {}, exact=True)  # on a graph of its own
