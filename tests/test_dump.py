
import graphopt
from graphopt.testing import zoo


def test_dump_layout(tmp_path):
    model, args, kwargs = zoo.gpt()
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, dump_dir=tmp_path, verify=True)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "summary.md" in names and "kernels" in names
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
    from graphopt.dump import note
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
