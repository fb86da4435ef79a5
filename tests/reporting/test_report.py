"""The optimization report: recompute's figures in a headline, every stat whole, and a budget
that asks for nothing said so, as a warning and in the notes."""
import dataclasses

import pytest
import torch

import graphopt
from graphopt.analysis.memory import size_text
from graphopt.demo.before_after import BeforeAfter, Line
from graphopt.errors import BudgetWarning
from graphopt.reporting.report import BudgetFit, PassRecord, Report

FIT = BudgetFit(budget_bytes=1_600_000, planned_for_bytes=1_600_000, peak_before_bytes=2_075_984,
                predicted_peak_bytes=1_547_600)
PLANNED = dict(segments=1, selective_segments=0, recomputed_nodes=4, recompute_flops=4_423_680,
               recompute_overhead_pct=16.4, cost_by="estimated time (cpu)", recompute_ms=0.26, written_in_place={})


def recompute_record(fit: BudgetFit = FIT, **stats) -> PassRecord:
    return PassRecord("recompute{budget_gb=0.0016}", 12.0, 17, 14, True, {**PLANNED, **stats},
                      peak_bytes=fit.predicted_peak_bytes, budget=fit)


def report(*records: PassRecord, **fields) -> Report:
    return Report("MLP", "fx", 5.0, 17, passes=[PassRecord("cse", 1.0, 17, 17, False, {"merged": 0}), *records],
                  **fields)


def test_the_headline_gives_recompute_figures_first():
    want = ("peak 2.1 MB -> 1.5 MB predicted (budget 1.6 MB); recompute adds 0.26 ms, 16.4% of the step, "
            "by estimated time (cpu)")
    planned = report(recompute_record())
    assert planned.to_text().splitlines()[0] == want
    assert planned.to_markdown().splitlines()[2] == want  # below the title
    calibrated = report(recompute_record(measured_peak_bytes=1_590_000)).to_text().splitlines()[0]
    assert calibrated.startswith("peak 2.1 MB -> 1.5 MB predicted (budget 1.6 MB), 1.6 MB measured (calibrate);")
    split = report(recompute_record(), microbatches=2).to_text().splitlines()[0]
    assert split.startswith("peak 2.1 MB -> 1.5 MB predicted for each of 2 microbatches (budget 1.6 MB)")
    assert report().to_text().splitlines()[0].split() == ["#", "pass", "ms", "nodes", "changed", "max", "err",
                                                          "peak", "stats"]  # no budget, no headline


def test_no_stat_is_cut():
    long = "x" * 150
    text = report(recompute_record(detail=long)).to_text()
    assert "recompute_flops=4423680" in text and "cost_by=estimated time (cpu)" in text
    assert "written_in_place={}" in text and "recompute_ms=0.26" in text
    # longer than the column: whole, on a line of its own below the record's first
    own = [line.strip() for line in text.splitlines() if long in line]
    assert own == [f"detail={long}"]
    # the others wrap within the column: table rows start with their number, continued lines with spaces
    lines = text.splitlines()
    stats_at = lines[1].index("stats")
    rows = [line for line in lines[3:] if line[:1] in ("0", " ") and long not in line]
    assert len(rows) > 3 and all(len(line) <= stats_at + 70 for line in rows)


def test_a_budget_above_the_peak_warns_and_the_report_notes_it():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    x = torch.randn(8, 16)
    with pytest.warns(BudgetWarning, match=r"nothing to recompute; budget_gb is in GB = 10\*\*9 bytes") as caught:
        opt = graphopt.optimize(model, (x,), budget_gb=10)
    assert [w.filename for w in caught if w.category is BudgetWarning] == [__file__]  # at the user's call
    fit = opt.graphopt_report.recompute().budget
    said = (f"budget_gb=10 (10.000 GB) is at or above the step's predicted peak of "
            f"{size_text(fit.peak_before_bytes)}: nothing to recompute")
    assert said in str(caught[0].message)
    assert any(line.startswith(said) for line in opt.graphopt_report.to_text().splitlines())
    assert f"- {said}" in opt.graphopt_report.to_markdown()
    assert opt.graphopt_report.to_text().splitlines()[0].endswith("(budget 10.000 GB); nothing recomputed")


def test_train_step_warns_of_a_budget_above_its_whole_batch():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    x = torch.randn(8, 16)
    with pytest.warns(BudgetWarning, match="nothing to recompute") as caught:
        step = graphopt.train_step(model, (x,), loss_fn=lambda out, x: out.square().mean(), budget_gb=10)
    assert step.microbatches == 1
    assert [w.filename for w in caught if w.category is BudgetWarning] == [__file__]
    assert any("nothing to recompute" in line for line in step.report.to_text().splitlines())


def test_the_idle_budget_note_only_where_the_budget_asked_for_nothing():
    idle = dict(fit=dataclasses.replace(FIT, peak_before_bytes=900_000, predicted_peak_bytes=900_000), segments=0)
    notes = report(recompute_record(**idle)).notes_text()
    assert notes[0].startswith("budget_gb=0.0016 (1.6 MB) is at or above the step's predicted peak of 900 kB")
    assert notes[0].endswith("(the peak is budget_gb=0.0009)")
    assert not any("nothing to recompute" in line for line in report(recompute_record()).notes_text())
    # one of train_step's microbatches fitting as it is: the budget chose the split, it was not idle
    assert not any("nothing to recompute" in line for line in report(recompute_record(**idle), microbatches=2).notes_text())


def test_a_refused_configuration_is_a_word_in_the_table_and_its_reason_below():
    why = "BudgetError: budget_gb=1e-09 (1 B) is below the 1.5 MB that one training step needs at least" + "." * 300
    result = BeforeAfter("tiny", 1, [Line("eager", {}, peak_bytes=2_600_000, step_ms=24.7),
                                     Line("graphopt", {"budget_gb": 1e-9}, refused=why)])
    text = result.to_text()
    row = next(line for line in text.splitlines() if line.startswith("graphopt "))
    assert row.split() == ["graphopt", "refused", "(see", "below)"]
    assert text.splitlines()[-1] == f"graphopt refused: {why}"
    assert why not in result.to_text(refusals=False) and result.refusals() == [("graphopt", why)]
    assert result.rows()[-1][-1] == f"refused: {why}"  # the markdown's table keeps its reason
