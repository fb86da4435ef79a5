import re

import pytest

import graphopt
import graphopt.reporting.plot
from graphopt.analysis.memory import estimate_peak
from graphopt.analysis.segments import SegmentCall
from graphopt.reporting.dump import code_diff
from graphopt.reporting.plot import BACKWARD_EVENTS, backward_start, memory_csv
from graphopt.testing import zoo
from graphopt.testing.baselines import budget_at
from graphopt.frontend.graph_inputs import placeholder_values


def test_dump_layout(tmp_path):
    model, args, kwargs = zoo.gpt()
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, dump_dir=tmp_path, verify=True)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "summary.md" in names and "kernels" not in names  # fuse runs on CUDA only by default
    assert {"00-trace.py", "00-trace.txt"} <= set(names)
    report = opt.graphopt_report
    for k, record in enumerate(report.passes, 1):
        stem = f"{k:02d}-{record.name}"
        files = {f"{stem}.py", f"{stem}.txt", f"{stem}.diff"}
        assert files <= set(names) if record.changed else not files & set(names)
    normalize = tmp_path / "01-normalize.diff"
    text = normalize.read_text()
    assert text.startswith("--- before") and "+" in text and "torch.nn.functional" in text
    code = (tmp_path / "01-normalize.py").read_text()
    assert "zoo.py" in code  # source locations of the nodes
    table = (tmp_path / "01-normalize.txt").read_text().splitlines()
    assert table[0].split()[:6] == ["name", "op", "target", "shape", "dtype", "bytes"]
    assert any("float32" in row and "[4, 32, 64]" in row for row in table)
    summary = (tmp_path / "summary.md").read_text()
    for record in report.passes:
        assert f"| {record.name} |" in summary
    assert "trace (fx)" in summary and "rel" in summary
    data = report.to_dict()
    assert [p["name"] for p in data["passes"]] == [r.name for r in report.passes]
    assert data["frontend"] == "fx" and data["passes"][0]["max_rel_err"] is not None


def test_dump_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_DUMP", str(tmp_path / "env"))
    model, args, _ = zoo.mlp()
    graphopt.optimize(model, args, passes=["dce"])
    assert (tmp_path / "env" / "summary.md").exists()
    assert not list((tmp_path / "env").glob("01-*"))  # dce changed nothing: summary row only


def test_passes_annotations_show_in_node_table(tmp_path):
    from graphopt.passes.notes import note
    from graphopt.passes import Pass, PassResult

    class Mark(Pass):
        """Marks every call with a stage number, as the pipeline pass will."""

        name = "mark"

        def run(self, gm, ctx):
            for n in gm.graph.nodes:
                if n.op.startswith("call"):
                    note(n, "stage", 0)
            return PassResult(gm, True, {"marked": True})

    model, args, _ = zoo.mlp()
    graphopt.optimize(model, args, passes=[Mark()], dump_dir=tmp_path)
    assert "stage=0" in (tmp_path / "01-mark.txt").read_text()


def test_stale_dumps_are_cleared(tmp_path):
    (tmp_path / "07-old.py").write_text("stale")
    model, args, _ = zoo.mlp()
    graphopt.optimize(model, args, dump_dir=tmp_path)
    assert not (tmp_path / "07-old.py").exists()


def _empty_folders(directory):
    return [p for p in directory.rglob("*") if p.is_dir() and not any(p.iterdir())]


def test_no_kernels_folder_without_kernels(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # on CPU, fuse then looks for no group
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "stale.py").write_text("from an earlier run")
    model, args, _ = zoo.mlp()
    opt = graphopt.optimize(model, args, passes="fuse", dump_dir=tmp_path)
    stats = opt.graphopt_report.passes[-1].stats
    assert stats["kernels"] == 0 and stats["not_run"]
    assert not (tmp_path / "kernels").exists() and not _empty_folders(tmp_path)


def test_kernels_folder_holds_the_generated_kernels(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, args, _ = zoo.mlp()
    opt = graphopt.optimize(model, args, passes="fuse", dump_dir=tmp_path)
    groups = opt.graphopt_report.passes[-1].stats["groups"]
    assert groups and sorted(p.stem for p in (tmp_path / "kernels").iterdir()) == sorted(g["name"] for g in groups)
    assert not _empty_folders(tmp_path)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A GPT planned at half its activations, dumped; the series each memory chart was drawn with."""
    model, args, kwargs = zoo.gpt()
    gm = graphopt.trace(model, args, kwargs)
    budget_gb = budget_at(estimate_peak(gm, placeholder_values(gm, args, kwargs)), 0.5)
    directory, charts = tmp_path_factory.mktemp("dump"), []
    draw = graphopt.reporting.plot._chart
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graphopt.reporting.plot, "_chart", lambda series, *rest: charts.append(series) or draw(series, *rest))
        opt = graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=budget_gb, dump_dir=directory)
    stem = f"{len(opt.graphopt_report.passes):02d}-recompute"
    assert opt.graphopt_report.passes[-1].stats["segments"] > 0
    return opt, directory, stem, charts


def test_memory_plot_marks_backward_at_its_first_event(planned):
    opt, directory, stem, charts = planned
    assert (directory / f"{stem}.memory.png").read_bytes().startswith(b"\x89PNG")
    rows = [line.split(",") for line in (directory / f"{stem}.memory.csv").read_text().splitlines()]
    assert rows[0] == ["curve", "index", "event", "live_bytes", "phase"]
    (series,) = charts
    assert len(series) == 2
    for label, (live, mark) in series.items():
        curve = [r for r in rows[1:] if label.startswith(f"{r[0]} (peak")]
        assert [int(r[3]) for r in curve] == live  # the chart draws the events the CSV lists
        events = [r[2] for r in curve]
        assert events[mark].startswith(BACKWARD_EVENTS) and [r[4] for r in curve].index("backward") == mark
        assert not any(e.startswith(BACKWARD_EVENTS) for e in events[:mark])
        assert events[mark - 1].startswith(("forward", "free"))  # right after the forward's last events
        assert not any(e.startswith("forward") for e in events[mark:])


def test_an_inference_step_has_no_backward_mark():
    model, args, kwargs = zoo.mlp()
    gm = graphopt.trace(model, args, kwargs)
    estimate = estimate_peak(gm, placeholder_values(gm, args, kwargs), train=False)
    assert any(event.startswith("forward") for event, _ in estimate.timeline)
    assert backward_start(estimate.timeline) is None
    assert {line.rsplit(",", 1)[1] for line in memory_csv({"eval": estimate}).splitlines()[1:]} == {"forward"}


_DEFINES = re.compile(r"^[-+] {8}(\w+)(?::| =)")  # a changed line of forward() computing a node


def test_recompute_keeps_the_names_and_its_diff_shows_only_the_plan(planned):
    opt, directory, stem, _ = planned
    calls = [n for n in opt.graph.nodes if isinstance(n.target, SegmentCall)]
    moved = {n.name for c in calls for n in c.target.module.graph.nodes
             if n.op not in ("placeholder", "output", "get_attr")}
    read = {n.name for c in calls for n in c.users}  # a segment's values, read under their nodes' names
    written = set(opt.graphopt_report.passes[-1].stats["written_in_place"])  # rewritten where they stand
    # the graph the pass was given: the last dump before its own
    given = sorted(p for p in directory.glob("[0-9][0-9]-*.txt") if p.name < stem)[-1]
    before = {line.split()[0] for line in given.read_text().splitlines()[1:]}
    after = {n.name for n in opt.graph.nodes}
    assert before <= after | moved
    assert after - before == {f"recompute_segment_{k}" for k in range(len(calls))}

    diff = (directory / f"{stem}.diff").read_text()
    main, _, segments = diff.partition("--- before (recompute segments)")
    assert segments.startswith("\n+++ after recompute (recompute segments)")
    removed = {m.group(1) for line in main.splitlines() if line.startswith("-") and (m := _DEFINES.match(line))}
    added = {m.group(1) for line in main.splitlines() if line.startswith("+") and (m := _DEFINES.match(line))}
    assert moved <= removed <= moved | written
    assert added <= read | written | {c.name for c in calls}
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    code = [line for line in changed if line[1:].strip() and not line[1:].lstrip().startswith("#")]
    # each moved node's line leaves the graph and enters its segment; each value read from a
    # segment, its line and its last use's; a segment's call, class, signature and return
    assert len(code) <= 2 * len(moved) + 2 * len(read) + 4 * len(calls) + 2 * len(written)


def test_a_segment_is_labelled_by_the_source_line_it_starts_at(planned):
    opt, directory, stem, _ = planned
    code = (directory / f"{stem}.py").read_text().splitlines()
    for call in [n for n in opt.graph.nodes if isinstance(n.target, SegmentCall)]:
        first = next(n for n in call.target.module.graph.nodes if n.op.startswith("call_"))
        line = next(i for i, text in enumerate(code) if text.strip().startswith(f"{call.name} = "))
        # fx writes a source line above the first of the nodes that share it
        label = next(text.strip() for text in reversed(code[:line]) if text.strip().startswith("# File:"))
        assert label.endswith(first.meta["stack_trace"].strip().splitlines()[-1].strip())


def test_the_diff_leaves_out_the_frees_a_moved_use_shifts():
    # fx frees a value after its last use (`;  x = None`); moving the use rewrites that line, not what it computes
    before = "    a = torch.relu(x)\n    b = a + 1;  a = None\n    return b\n"
    after = "    a = torch.relu(x);  a = None\n    b = seg(x)\n    return b\n"
    changed = [line for line in code_diff((before, ""), (after, ""), "p").splitlines()
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert changed == ["-    b = a + 1", "+    b = seg(x)"]
