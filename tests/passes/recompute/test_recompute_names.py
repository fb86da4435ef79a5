"""The recompute rewrite keeps node names: a plan's dump diff shows what it changed, nothing more."""
import pytest

import graphopt
from graphopt.analysis.segments import SegmentCall
from graphopt.passes.recompute.rewrite import checkpoint_segments, inline_segments, recomputable
from graphopt.testing import zoo

from conftest import assert_same_step


def _gpt_blocks():
    model, args, kwargs = zoo.gpt(batch=2, seq=16, layers=2)
    gm = graphopt.trace(model, args, kwargs)
    return model, args, kwargs, gm, lambda: zoo.block_segments(gm)


def _convnet_runs():
    """Export's aten graph, its batch norms in training: in a segment they become batch_norm_once.
    Segments are the runs of calls between the statistics' counter writes, which run once."""
    model, args, kwargs = zoo.convnet(blocks=2)
    gm = graphopt.trace(model, args, kwargs, frontend="export")

    def runs():
        found, run = [], []
        for n in gm.graph.nodes:
            if n.op == "call_function" and recomputable(n, gm) is None:
                run.append(n)
            else:
                found, run = found + [run] * (len(run) > 1), []
        return found
    return model, args, kwargs, gm, runs


@pytest.mark.parametrize("make", [_gpt_blocks, _convnet_runs], ids=["gpt", "convnet-export"])
def test_segments_keep_the_names_and_undoing_them_gives_the_graph_back(make):
    model, args, kwargs, gm, segments = make()
    names, code = [n.name for n in gm.graph.nodes], gm.code
    for _ in range(3):  # the recompute pass rewrites and undoes a plan for each one it looks at
        planned = segments()
        moved = {n.name for seg in planned for n in seg if n.op != "get_attr"}
        checkpoint_segments(gm, planned)
        calls = [n for n in gm.graph.nodes if isinstance(n.target, SegmentCall)]
        inside = {n.name for c in calls for n in c.target.module.graph.nodes if n.op not in ("placeholder", "output")}
        main = {n.name for n in gm.graph.nodes}
        assert set(names) <= main | inside
        assert main - set(names) == {f"recompute_segment_{k}" for k in range(len(planned))}
        assert main & moved == {n.name for c in calls for n in c.users}  # the values read from a segment
        assert any("batch_norm_once" in c.target.module.code for c in calls) == (make is _convnet_runs)
        inline_segments(gm)
        assert [n.name for n in gm.graph.nodes] == names
        assert gm.code == code
    checkpoint_segments(gm, segments())
    assert_same_step(model, gm, args, kwargs, exact=False)
