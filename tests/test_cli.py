import json
import subprocess
import sys

import pytest

from graphopt.__main__ import main

SUMMARY_KEYS = {"eager_peak_bytes", "optimized_peak_bytes", "budget_bytes", "eager_step_ms", "optimized_step_ms"}


@pytest.mark.slow  # two minutes: the demo measures four training steps in turns
def test_demo_measures_the_story(tmp_path, capsys):
    assert main(["demo", "--dump", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    # the promise the demo shows: under the budget, which is under what eager needs
    assert summary["optimized_peak_bytes"] <= summary["budget_bytes"] < summary["eager_peak_bytes"]
    labels = [line["label"] for line in summary["lines"]]
    assert labels[0] == "eager" and "budget + bf16" in labels and "budget + inplace" in labels
    assert all(line["peak_bytes"] <= summary["budget_bytes"] for line in summary["lines"][1:] if not line["refused"])
    assert "measured peak" in out and "recomputed" in out and "segments" in out
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    assert "| eager |" in (tmp_path / "summary.md").read_text()


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
    assert "recompute" in capsys.readouterr().out
    assert list(tmp_path.glob("*-recompute.memory.png"))
    assert main(["optimize", "graphopt.testing.zoo:mlp", "--inputs", "torch.randn(512, 64)", "--calibrate"]) == 2
    assert "budget_gb" in capsys.readouterr().err


def test_cli_errors_are_one_line(capsys):
    assert main(["optimize", "graphopt.testing.zoo:MLP"]) == 2
    assert "--inputs" in capsys.readouterr().err
    assert main(["optimize", "graphopt.testing.zoo:mlp", "--stages", "99"]) == 2
    assert "places where a cut" in capsys.readouterr().err
    assert main(["optimize", "nowhere"]) == 2


def test_help():
    out = subprocess.run([sys.executable, "-m", "graphopt", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "demo" in out.stdout and "optimize" in out.stdout
