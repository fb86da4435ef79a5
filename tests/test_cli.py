import subprocess
import sys


from graphopt.__main__ import main


def test_demo(tmp_path, capsys):
    assert main(["demo", "--dump", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "trace (fx)" in out and "normalize" in out and "cse" in out
    assert str(tmp_path) in out and (tmp_path / "summary.md").exists()


def test_optimize_a_users_model(tmp_path, capsys):
    assert main(["optimize", "graphopt.testing.zoo:mlp", "--dump", str(tmp_path), "--verify"]) == 0
    assert "dce" in capsys.readouterr().out
    assert main(["optimize", "graphopt.testing.zoo:MLP", "--inputs", "torch.randn(4, 64)", "--passes", "cse"]) == 0


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
