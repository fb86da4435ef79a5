import datetime
from pathlib import Path

import torch

from graphopt.__main__ import main
from graphopt.demo.before_after import BeforeAfter, Line
from graphopt.demo.run import demo_configs, machine, record_markdown


def _result() -> BeforeAfter:
    result = BeforeAfter("a model", budget_bytes=90_000_000, dumped="graphopt: budget", seconds=97.4)
    result.lines = [Line("eager", {}, peak_bytes=150_000_000, step_ms=140.0),
                    Line("graphopt: budget", {"budget_gb": 0.09}, peak_bytes=89_000_000, step_ms=150.0,
                         predicted_bytes=89_000_000, recomputed="68 nodes in 9 segments")]
    return result


def test_each_line_is_a_configuration_at_its_best():
    # inplace runs inside the budget's plan already; a line of it beside the budget showed it at its worst
    cpu = demo_configs(0.1, "cpu")
    assert list(cpu) == ["graphopt: budget", "budget + bf16"]
    assert all("inplace" not in str(options.get("passes", "")) for options in cpu.values())
    assert list(demo_configs(0.1, "cuda")) == ["graphopt: budget", "budget + fuse", "budget + bf16"]


def test_the_record_says_when_where_and_how_long():
    result = _result()
    when = datetime.datetime(2026, 11, 27, 9, 30, tzinfo=datetime.timezone.utc)
    text = record_markdown(result, result.to_text(), "graphopt-dump", when=when, cpu_seconds=80.2)
    assert "2026-11-27 09:30" in text and "total time 97 s wall clock, 80 s of CPU" in text
    assert f"torch: {torch.__version__}" in text and "- cpu: " in text
    assert "```\n" + result.to_text() + "\n```" in text
    assert "the 'graphopt: budget' configuration's" in text


def test_the_machine_names_its_cpu_and_torch():
    host = machine()
    assert host["cpu"] and host["torch"] == torch.__version__ and int(host["cores"]) >= 1
    assert host["torch threads"] == str(torch.get_num_threads())


def test_summary_md_names_the_configuration_the_dumps_belong_to():
    assert "are the 'graphopt: budget' configuration's" in _result().to_markdown()
    undumped = _result()
    undumped.dumped = None
    assert "configuration's" not in undumped.to_markdown()


def test_an_unwritable_record_is_refused_before_the_run(tmp_path, capsys):
    assert main(["demo", "--dump", str(tmp_path / "d"), "--record", str(tmp_path)]) == 2
    assert "--record" in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_the_readme_quotes_the_recorded_run():
    # the README's demo figures are docs/demo.md's, the record the demo itself wrote: none typed by hand
    root = Path(__file__).resolve().parents[2]
    recorded = (root / "docs" / "demo.md").read_text().split("```\n")[1].rstrip("\n").splitlines()
    readme = (root / "README.md").read_text()
    assert len(recorded) >= 5 and "\n".join("    " + line if line else "" for line in recorded) in readme
