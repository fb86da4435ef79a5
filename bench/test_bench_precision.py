"""Half precision, measured in one run against its baselines (precision_figures.py).

A GPT training step (forward, loss, backward) in float32, through graphopt's precision pass
in bf16, and under torch.autocast in bf16: step times as ratios (goal on a GPU: >= 1.8x over
float32, within 5% of autocast), measured peaks, and the loss against autocast's.
Figures are printed at the end of the run (bench/conftest.py).
"""
import precision_figures as pf
from conftest import rounds


def test_precision_step_time(benchmark, quick, figures):
    size = "quick" if quick else pf.DEVICE
    row = benchmark.pedantic(lambda: pf.precision_run(size, rounds(quick, 9), memory=not quick), rounds=1, iterations=1)
    figures(**row)
    assert row["loss_rel_diff_vs_autocast"] < 0.05  # the same computation as autocast's, in bf16
