"""The memory pictures start where the step does: with its resident state counted, not climbing from zero."""
import pytest
import torch

import graphopt
from graphopt.analysis.live_storage import from_first_op
from graphopt.analysis.memory import estimate_peak
from graphopt.reporting.plot import memory_png
from graphopt.runtime.step import step_timeline
from graphopt.frontend.graph_inputs import placeholder_values


class _Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))

    def forward(self, x):
        return self.net(x).square().mean()


def _model():
    torch.manual_seed(0)
    return _Regressor()


def _resident_bytes(model, x):
    return sum(t.untyped_storage().nbytes() for t in [*model.parameters(), x])


def test_resident_events_fold_into_the_first_point():
    timeline = [("parameters", 10), ("parameters", 30), ("inputs", 35), ("", 60), ("free", 40)]
    assert from_first_op(timeline) == [("resident", 35), ("", 60), ("free", 40)]
    assert from_first_op([("", 5), ("free", 0)]) == [("resident", 0), ("", 5), ("free", 0)]  # nothing resident


def test_the_measured_and_the_predicted_curve_start_at_parameters_and_inputs():
    model, x = _model(), torch.randn(32, 64)
    measured = step_timeline(model, model, (x,))
    assert measured[0] == _resident_bytes(model, x) and max(measured) > measured[0]
    gm = graphopt.trace(model, (x,))
    estimate = estimate_peak(gm, placeholder_values(gm, (x,), {}))
    assert from_first_op(estimate.timeline)[0] == ("resident", _resident_bytes(model, x))
    pytest.importorskip("matplotlib")
    assert memory_png({"eager": estimate}, budget_bytes=estimate.peak_bytes).startswith(b"\x89PNG")
