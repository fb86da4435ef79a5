"""The analysis cache: a fact is computed once per graph version, and never served stale."""
import torch

import graphopt
from graphopt.analysis.memory import GB, estimate_peak
from graphopt.analysis.saved import record_step
from graphopt.passes.base import PassContext
from graphopt.passes.inplace import Inplace
from graphopt.passes.recompute.recompute_pass import Recompute
from graphopt.testing import zoo


def _graph(**sizes):
    model, args, kwargs = zoo.gpt(**sizes)
    gm = graphopt.optimize(model, args, example_kwargs=kwargs, passes="normalize,cse,dce")  # no inplace yet
    return gm, PassContext(args, kwargs, train=True)


def test_a_fact_is_computed_once_per_graph_version():
    gm, ctx = _graph()
    first = ctx.analysis(estimate_peak, gm)
    assert ctx.analysis(estimate_peak, gm, train=True) is first  # defaults spelled out: the same call
    assert ctx.analysis(estimate_peak, gm, train=False) is not first
    assert ctx.analysis(record_step, gm) is ctx.analysis(record_step, gm)
    assert ctx.analyses.computed == {"estimate_peak": 2, "record_step": 1}


def test_a_changed_graph_or_state_gets_a_new_fact():
    gm, ctx = _graph()
    before = ctx.analysis(estimate_peak, gm)
    # a rewrite no one reported: the cache sees the graph is not the one it computed for
    gelu = next(n for n in gm.graph.nodes if n.target is torch.nn.functional.gelu)
    gelu.kwargs = {"approximate": "none"}
    gm.recompile()
    assert ctx.analysis(estimate_peak, gm) is not before
    # the state's dtype changes the step's memory without touching the graph
    again = ctx.analysis(estimate_peak, gm)
    gm.to(torch.float64)
    doubled = ctx.analysis(estimate_peak, gm)
    assert doubled is not again and doubled.peak_bytes > again.peak_bytes


def test_recompute_takes_inplaces_last_estimate():
    gm, ctx = _graph(batch=8, seq=64)
    result = Inplace().run(gm, ctx)
    assert result.changed
    peak = ctx.analysis(estimate_peak, gm).peak_bytes
    assert ctx.analyses.computed["estimate_peak"] == 2  # inplace's before and after; the last asked again
    Recompute(budget_gb=0.7 * peak / GB).run(gm, ctx)
    assert ctx.analyses.computed["estimate_peak"] == 2  # recompute's step 1 is inplace's after
