"""graphopt.check_estimate: the estimate every budget is planned by, held against the same step
run for real, storage by storage; where they part, the first storage is named."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.analysis import fake_kernels
from graphopt.__main__ import main


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 16))

    def forward(self, x, target):
        return F.mse_loss(self.body(x), target)


def _example():
    return (torch.randn(512, 16), torch.randn(512, 16))


def test_the_estimate_agrees_with_the_real_step_storage_for_storage_and_leaves_the_model_as_it_was():
    model, args = Regressor(), _example()
    before = [p.detach().clone() for p in model.parameters()]
    checked = graphopt.check_estimate(model, args)
    assert checked.divergence is None and checked.predicted_bytes == checked.measured_bytes and checked.error == 0
    assert "every storage agrees" in str(checked)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # so does an optimized graph's, with an optimizer's state and gradients accumulated
    opt = graphopt.optimize(model, args, budget_gb=checked.measured_bytes * 0.9 / 1e9)
    planned = graphopt.check_estimate(opt, args, optimizer="adamw", accumulate=True)
    assert planned.divergence is None and planned.predicted_bytes == planned.measured_bytes


def test_a_fake_that_misses_a_real_kernels_storage_is_named_where_it_parts(monkeypatch):
    """Without its rule in fake_kernels, a reduced MSE loss is 4 bytes in the estimate, where the
    real kernel returns it over the buffer of its elementwise values."""
    monkeypatch.setattr(fake_kernels, "_REDUCED_IN_PLACE", {})
    checked = graphopt.check_estimate(Regressor(), _example())
    assert checked.error < 0
    assert checked.divergence is not None and "mse_loss" in checked.divergence.where
    assert checked.divergence.estimated == "made 4 bytes with aten.mse_loss.default"
    assert checked.divergence.measured == "made 32,768 bytes with aten.mse_loss.default"


def test_check_estimate_refuses_what_has_no_step_to_check():
    with pytest.raises(graphopt.UsageError, match="needs a torch.nn.Module"):
        graphopt.check_estimate(lambda x: x, _example())
    with pytest.raises(graphopt.UsageError, match="builds one per call"):
        graphopt.check_estimate(graphopt.optimize(Regressor()), _example())
    with pytest.raises(graphopt.UsageError, match="optimizer"):
        graphopt.check_estimate(Regressor(), _example(), optimizer="lion")


def test_the_command_line_checks_a_users_model(capsys):
    assert main(["check-estimate", "graphopt.testing.zoo:gpt"]) == 0
    assert "every storage agrees" in capsys.readouterr().out
