"""Side effects as eager has them: forward's buffer updates happen in the graph, once per call,
and nothing graphopt runs for itself leaves a trace on the user's state."""
import copy

import pytest
import torch

import graphopt
from graphopt.analysis.memory import estimate_peak
from graphopt.testing.baselines import budget_at
from graphopt.frontend.graph_inputs import placeholder_values


class EMA(torch.nn.Module):
    """Updates an EMA buffer in place and counts its calls by rebinding a buffer."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        y = self.lin(x)
        self.ema.mul_(0.9).add_(y.mean(0).detach(), alpha=0.1)
        self.steps += 1
        return y * self.ema


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_buffer_updates_in_forward_happen_once_per_call(frontend):
    model, x = EMA(), torch.randn(3, 4)
    eager = copy.deepcopy(model)
    opt = graphopt.optimize(model, (x,), frontend=frontend)
    assert int(model.steps) == 0 and not model.ema.any()  # tracing and the passes wrote nothing
    for _ in range(3):
        assert torch.equal(opt(x), eager(x))
    assert int(model.steps) == int(eager.steps) == 3
    assert torch.equal(model.ema, eager.ema)


class Retyped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps = self.steps + 1.5  # eager makes the buffer a float tensor
        return x * 2


@pytest.mark.parametrize("frontend", ["auto", "fx"])
def test_a_buffer_rebound_to_another_dtype_is_refused_and_left_untouched(frontend):
    # export would copy 1.5 into the int64 buffer: auto must not fall back to it
    model = Retyped()
    with pytest.raises(graphopt.TraceError, match=r"rebinds buffer steps \(int64\[\]\) to float32\[\]") as e:
        graphopt.optimize(model, (torch.randn(2),), frontend=frontend)
    assert "export" not in e.value.reasons
    assert model.steps.dtype == torch.long and int(model.steps) == 0


class Scales(torch.nn.Module):
    """Writes into an input (a user's choice eager honours once per call), has BatchNorm and
    dropout, and activations enough for the recompute pass to plan (and so measure)."""

    def __init__(self, width=64, depth=6):
        super().__init__()
        self.body = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width),
                                                              torch.nn.GELU(), torch.nn.Dropout(0.3))
                                          for _ in range(depth)])

    def forward(self, x, count):
        count.add_(1)
        return self.body(x) + x * count


@pytest.mark.parametrize("options", [dict(verify=True), dict(calibrate=True), dict(profile=True)],
                         ids=["verify", "calibrate", "profile"])
def test_what_graphopt_runs_for_itself_leaves_no_trace(options):
    model = Scales()
    x, count = torch.randn(512, 64, requires_grad=True), torch.zeros(())
    if "verify" not in options:  # a budget the recompute pass meets by recomputing: it measures
        traced = graphopt.trace(model, (x, count))
        options["budget_gb"] = budget_at(estimate_peak(traced, placeholder_values(traced, (x, count), {})), 0.6)
    x_before, state_before = x.detach().clone(), copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    opt = graphopt.optimize(model, (x, count), passes=[], **options)
    if "verify" not in options:
        assert opt.graphopt_report.passes[-1].stats["recomputed_nodes"] > 0
    assert x.grad is None and torch.equal(x.detach(), x_before) and float(count) == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, state_before[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


class Hidden(torch.nn.Module):
    """Reaches its buffer through a list: fx would run the update once, at trace time."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.store = [self.calls]

    def forward(self, x):
        self.store[0].add_(1)
        return x * 2


def test_a_write_fx_cannot_record_is_refused_and_undone():
    model = Hidden()
    with pytest.raises(graphopt.TraceError, match=r"tracing wrote calls in place outside the graph"):
        graphopt.optimize(model, (torch.randn(2),), frontend="fx")
    assert float(model.calls) == 0
    opt = graphopt.optimize(model, (torch.randn(2),))  # export records it, and tracing leaves it alone
    assert opt.graphopt_report.frontend == "export" and float(model.calls) == 0
    opt(torch.randn(2))
    assert float(model.calls) == 1
