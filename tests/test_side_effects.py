"""Side effects as eager has them: forward's buffer updates happen in the graph, once per call,
and nothing graphopt runs for itself leaves a trace on the user's state."""
import copy

import pytest
import torch

import graphopt


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
