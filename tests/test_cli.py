import json
import subprocess
import sys
import textwrap

import pytest
import torch

from graphopt.__main__ import main
from graphopt.reporting.cli_text import cli_text

SUMMARY_KEYS = {"eager_peak_bytes", "optimized_peak_bytes", "budget_bytes", "eager_step_ms", "optimized_step_ms"}

# a tiny model the command line imports from the test's directory: `scalar` says whether its output is a loss
TINY = """
import torch

BUILT = []


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        y = self.norm(self.lin(x))
        return y.square().mean() if SCALAR else y


def build():
    BUILT.append(Tiny())
    return BUILT[-1], (torch.randn(4, 8),), {}
"""


def tiny(tmp_path, monkeypatch, scalar: bool):
    """The factory spec of a tiny model in a module of its own (a module name per kind: imports are cached)."""
    name = f"cli_tiny_{'loss' if scalar else 'tensor'}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(TINY).replace("SCALAR", str(scalar)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return f"{name}:build"


@pytest.mark.slow  # two minutes: the demo optimizes twice and measures three training steps in turns
def test_demo_measures_the_story(tmp_path, capsys):
    record = tmp_path / "docs" / "demo.md"
    assert main(["demo", "--dump", str(tmp_path), "--record", str(record)]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    # the promise the demo shows: under the budget, which is under what eager needs
    assert summary["optimized_peak_bytes"] <= summary["budget_bytes"] < summary["eager_peak_bytes"]
    labels = [line["label"] for line in summary["lines"]]
    assert labels == ["eager", "graphopt: budget", "budget + bf16"]
    assert all(line["peak_bytes"] <= summary["budget_bytes"] for line in summary["lines"][1:] if not line["refused"])
    assert "measured peak" in out and "recomputed" in out and "segments" in out
    assert "the 'graphopt: budget' configuration's" in out
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    summary_md = (tmp_path / "summary.md").read_text()
    assert "| eager |" in summary_md and "are the 'graphopt: budget' configuration's" in summary_md
    # the record holds the table the terminal showed, with the machine and the time it took
    written = record.read_text()
    assert "graphopt: budget" in written and "torch: " in written and "total time" in written


def test_measure_a_users_model(tmp_path, capsys):
    args = ["optimize", "graphopt.testing.zoo:gpt", "--budget-gb", "0.002", "--measure", "--dump", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary) and summary["optimized_peak_bytes"] <= summary["budget_bytes"] == 2_000_000
    assert "eager" in out and "graphopt" in out and (tmp_path / "memory.png").exists()
    # an output with no loss: the error says how to give one
    assert main(["optimize", "graphopt.testing.zoo:mlp", "--measure", "--dump", str(tmp_path)]) == 2
    assert "--loss pkg.module:function" in capsys.readouterr().err
    assert main(["optimize", "graphopt.testing.zoo:mlp", "--measure", "--loss", "nowhere"]) == 2
    assert "pkg.module:function" in capsys.readouterr().err


def test_optimize_a_users_model(tmp_path, capsys):
    assert main(["optimize", "graphopt.testing.zoo:mlp", "--dump", str(tmp_path), "--verify"]) == 0
    assert "dce" in capsys.readouterr().out
    assert main(["optimize", "graphopt.testing.zoo:MLP", "--inputs", "torch.randn(4, 64)", "--passes", "cse"]) == 0


def test_optimize_a_language_model_given_its_input_ids_as_labels(capsys):
    # zoo.hf_gpt2 gives labels=input_ids, one tensor: --verify holds the graph to eager on a second
    # batch too, whose labels are drawn apart from its input_ids
    assert main(["optimize", "graphopt.testing.zoo:hf_gpt2", "--verify"]) == 0
    assert "export" in capsys.readouterr().out


def test_optimize_under_a_budget(tmp_path, capsys):
    args = ["optimize", "graphopt.testing.zoo:mlp", "--inputs", "torch.randn(512, 64)", "--budget-gb", "0.0016",
            "--calibrate", "--dump", str(tmp_path)]
    assert main(args) == 0
    out, err = capsys.readouterr()
    # the headline: recompute's figures, the measured peak of calibrate among them
    assert out.startswith("peak ") and "predicted (budget 1.6 MB)" in out.splitlines()[0]
    assert "measured (calibrate); recompute adds" in out.splitlines()[0]
    assert "graphopt: warning" not in err  # a budget below the peak is not idle
    assert list(tmp_path.glob("*-recompute.memory.png"))
    assert main(["optimize", "graphopt.testing.zoo:mlp", "--inputs", "torch.randn(512, 64)", "--calibrate"]) == 2
    assert "--calibrate refines what --budget-gb asks for: give --budget-gb too." in capsys.readouterr().err


def test_cli_errors_are_one_line(capsys):
    assert main(["optimize", "graphopt.testing.zoo:MLP"]) == 2
    assert "--inputs" in capsys.readouterr().err
    assert main(["optimize", "graphopt.testing.zoo:mlp", "--stages", "99"]) == 2
    assert "places where a cut" in capsys.readouterr().err
    assert main(["optimize", "nowhere"]) == 2


def test_measure_without_a_loss_stops_before_optimizing(tmp_path, monkeypatch, capsys):
    spec = tiny(tmp_path, monkeypatch, scalar=False)
    assert main(["optimize", spec, "--measure", "--budget-gb", "1e-3", "--dump", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--loss pkg.module:function" in err and "loss_fn" not in err
    assert "optimizing" not in err and not (tmp_path / "out").exists()  # told before any optimizing
    # the forward that found out left the model as it was: BatchNorm's statistics untouched
    model = sys.modules["cli_tiny_tensor"].BUILT[-1]
    assert int(model.norm.num_batches_tracked) == 0 and torch.equal(model.norm.running_mean, torch.zeros(8))


def test_measure_prints_a_refusal_as_an_error_below_the_table(tmp_path, monkeypatch, capsys):
    spec = tiny(tmp_path, monkeypatch, scalar=True)
    assert main(["optimize", spec, "--measure", "--budget-gb", "1e-9", "--dump", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    row = next(line for line in out.splitlines() if line.startswith("graphopt "))
    assert row.split() == ["graphopt", "refused", "(see", "below)"] and "BudgetError" not in out
    error = next(line for line in err.splitlines() if line.startswith("graphopt: error: "))
    assert error.startswith("graphopt: error: graphopt refused: BudgetError: --budget-gb 1e-09 (")
    assert "graphopt.train_step" in error and "--precision bf16" in error and "budget_gb" not in error
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["lines"][1]["refused"]


def test_a_budget_above_the_peak_warns_in_flags(tmp_path, monkeypatch, capsys):
    assert main(["optimize", tiny(tmp_path, monkeypatch, scalar=True), "--budget-gb", "10"]) == 0
    out, err = capsys.readouterr()
    said = "--budget-gb 10 (10.000 GB) is at or above the step's predicted peak of "
    assert f"graphopt: warning: {said}" in err and "--budget-gb is in GB = 10**9 bytes" in err
    assert any(line.startswith(said) for line in out.splitlines())  # and the report's note
    assert "recompute{budget_gb=10.0}" in out  # a pass spec, as --passes takes it


def test_errors_speak_in_flags(tmp_path, monkeypatch, capsys):
    spec = tiny(tmp_path, monkeypatch, scalar=True)
    assert main(["optimize", spec, "--budget-gb", "1e-9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphopt: error: --budget-gb 1e-09 (") and "Raise --budget-gb to " in err
    assert "--precision bf16" in err and "--stages N" in err and "_gb" not in err and "=" not in err
    # the library's advice of train_step, in the command line's terms: plan says how many microbatches fit
    assert "graphopt.train_step in Python (`python -m graphopt plan MODEL --budget-gb B` says how many" in err
    assert main(["optimize", spec, "--profile"]) == 2
    assert "--profile refines what --budget-gb or --stages asks for: give one of them too." in capsys.readouterr().err
    assert cli_text("optimize(budget_gb=...): bad value -1.0") == "--budget-gb: bad value -1.0"
    assert cli_text("with stages=, budget_gb caps each stage: leave calibrate out") == \
        "with --stages, --budget-gb caps each stage: leave --calibrate out"
    assert cli_text("give train=True, or frontend='fx'") == "give --mode train, or --frontend fx"
    assert cli_text("give loss_fn=... (on the command line, --loss pkg.module:function), a function") == \
        "give --loss pkg.module:function, a function"
    # what --passes takes stays as it is written there
    assert cli_text("pass 'recompute', option 'budget_gb': e.g. recompute{budget_gb=8}") == \
        "pass 'recompute', option 'budget_gb': e.g. recompute{budget_gb=8}"


def test_help():
    out = subprocess.run([sys.executable, "-m", "graphopt", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "demo" in out.stdout and "optimize" in out.stdout
