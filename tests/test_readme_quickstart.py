"""The README's quickstart, run as written on a small model of the kind it describes."""
import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphopt

README = Path(__file__).resolve().parent.parent / "README.md"


@dataclasses.dataclass
class Output:
    loss: torch.Tensor


class Classifier(nn.Module):
    """A model whose output has a .loss, given its labels, as the quickstart asks."""

    def __init__(self, width=128, depth=8, classes=10):
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, x, labels):
        return Output(F.cross_entropy(self.head(self.body(x)), labels))


def quickstart() -> str:
    section = README.read_text().split("## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def run(code: str, width=128, depth=8, rows=1024) -> dict:
    torch.manual_seed(0)
    model = Classifier(width, depth).train()
    loader = [(torch.randn(rows, width), torch.randint(0, 10, (rows,))) for _ in range(3)]
    first = [p.detach().clone() for p in model.parameters()]
    namespace = {"model": model, "loader": loader}
    exec(compile(code, str(README), "exec"), namespace)
    namespace["trained"] = any(not torch.equal(p, q) for p, q in zip(model.parameters(), first))
    return namespace


def test_the_quickstart_runs_and_fits_its_budget():
    done = run(quickstart())
    assert done["trained"]  # the loop's optimizer stepped the model's own parameters through opt
    assert done["budget_gb"] == 0.7 * done["before"].peak_gb  # the budget it asked for, not the except's
    assert done["after"].peak_gb <= done["budget_gb"]  # with AdamW's state and step, as both count it
    assert "recompute" in str(done["opt"].graphopt_report)
    assert "AdamW" in done["opt"].graphopt_report.recompute().name


def test_below_the_least_budget_the_quickstart_takes_the_least():
    # the except branch: optimize at the BudgetError's min_budget_gb succeeds, and the step fits it
    code = quickstart()
    assert "0.7 * before.peak_gb" in code
    done = run(code.replace("0.7 * before.peak_gb", "0.01 * before.peak_gb"), width=64, depth=3, rows=512)
    assert done["before"].peak_gb * 0.01 < done["budget_gb"] < done["before"].peak_gb
    assert done["after"].peak_gb <= done["budget_gb"]


def test_a_budget_above_the_peak_warns():
    model = Classifier().train()
    x, y = torch.randn(1024, 128), torch.randint(0, 10, (1024,))
    peak = graphopt.measure_step(model, (x,), {"labels": y}).peak_gb
    with pytest.warns(graphopt.BudgetWarning):
        graphopt.optimize(model, (x,), example_kwargs={"labels": y}, budget_gb=1.5 * peak)
