"""Fusion across reshapes: candidates joined by reshapes compute in one shape F, so one group
takes them all (passes/fuse/view_frames.py, passes/fuse/views.py): Swin's attention scores, a
bias added before and a mask after a reshape, then a softmax; LeViT's BatchNorm1d of
x.flatten(0, 1) reshaped back and activated."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_same_step
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from test_fuse import fused_nodes, group_nodes, leaves, module

import graphopt
from graphopt.passes.fuse.view_frames import refinement, written_in
from graphopt.errors import GraphoptError

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def normalized_and_fused(fn, *args, **modules):
    model = module(fn, len(args), **modules)
    opt = graphopt.optimize(model, args, passes="normalize,fuse", verify=True)
    return model, opt, opt.graphopt_report.passes[-1].stats


def shifted_window_scores(m, s, bias, mask):
    """timm's and torchvision's Swin: [B*nW, H, N, N] scores, a relative-position bias per head,
    a mask per window read through a view of [B, nW, H, N, N], the softmax over the keys."""
    a = s + bias
    a = a.view(2, 4, 3, 16, 16) + mask
    return torch.softmax(a.view(-1, 3, 16, 16), -1)


def test_a_bias_a_mask_and_a_softmax_across_two_views_are_one_group():
    s, bias, mask = leaves((8, 3, 16, 16), (1, 3, 16, 16), (1, 4, 1, 16, 16))
    model, opt, stats = normalized_and_fused(shifted_window_scores, s, bias, mask)
    assert group_nodes(stats) == [["add", "add_1", "softmax"]]
    assert stats["view_regions"] == [{"nodes": ["add", "view", "add_1", "view_1", "softmax"], "shape": [2, 4, 3, 16, 16]}]
    assert stats["memory_bound_ops_unfused"] == 0
    # the inputs enter in F, the result leaves in its own shape; no reshape is left between them
    reshapes = [n for n in opt.graph.nodes if n.target == "reshape"]
    assert [tuple(n.args[1:]) for n in reshapes] == [(2, 4, 3, 16, 16), (1, 1, 3, 16, 16), (8, 3, 16, 16)]
    assert_same_step(model, opt, (s, bias, mask), {}, exact=False)


def test_a_graph_fused_across_views_runs_at_the_example_shapes_only():
    s, bias, mask = leaves((8, 3, 16, 16), (1, 3, 16, 16), (1, 4, 1, 16, 16))
    _, opt, _ = normalized_and_fused(shifted_window_scores, s, bias, mask)
    assert "fused groups compute across reshapes" in opt.graphopt_report.runs_at
    with pytest.raises(GraphoptError, match="fused groups compute across reshapes"):
        opt(torch.randn(16, 3, 16, 16), bias, mask)


def test_a_batch_norm_of_flattened_tokens_joins_the_activation_after_its_reshape():
    """LeViT: the norm computes in its own shape [B*N, C], which becomes F; the activation reads
    the norm's value in it and leaves reshaped to [B, N, C]."""
    def fn(m, x, w):
        h = x @ w
        return F.hardswish(m.bn(h.flatten(0, 1)).reshape_as(h)) * 2.0
    x, w = leaves((2, 16, 8), (8, 8))
    model, opt, stats = normalized_and_fused(fn, x, w, bn=nn.BatchNorm1d(8))
    assert group_nodes(stats) == [["bn", "hardswish", "mul"]]
    assert stats["view_regions"][0]["shape"] == [32, 8]
    assert_same_step(model, opt, (x, w), {}, exact=False)
    assert torch.equal(opt.get_buffer("bn.running_mean"), model.bn.running_mean)


def test_a_norm_over_a_last_dim_that_a_view_splits_computes_in_its_own_shape():
    """The refinement [4, 2, 8] would split the layer norm's rows: F is the norm's shape, the
    product after the view reads its operand in it."""
    def fn(m, x, y):
        h = m.ln(x * 2.0 + 1.0)
        return h.view(4, 2, 8) * y
    x, y = leaves((4, 16), (4, 2, 8))
    model, opt, stats = normalized_and_fused(fn, x, y, ln=nn.LayerNorm(16))
    assert stats["view_regions"][0]["shape"] == [4, 16] and group_nodes(stats) == [["mul", "add", "ln", "mul_1"]]
    assert_same_step(model, opt, (x, y), {}, exact=False)


def test_shapes_with_no_common_refinement_are_left_as_they_are():
    def fn(m, x, y):
        return (x * 2.0).view(4, 6) + y
    x, y = leaves((6, 4), (4, 6))
    model, opt, stats = normalized_and_fused(fn, x, y)
    assert stats["view_regions"] == [] and not fused_nodes(opt)
    assert opt.graphopt_report.runs_at == "any shapes the model takes (torch.fx)"
    assert_same_step(model, opt, (x, y), {})


def test_a_view_written_in_place_stays_between_groups():
    """A write through the view changes what its base holds: no region reads across it."""
    def fn(m, x, y):
        h = x.exp() * 2.0
        v = h.view(4, 2, 4)
        v.mul_(y)
        return h.sin() + 1.0
    x, y = leaves((4, 8), (4, 2, 4))
    x, y = x.detach(), y.detach()
    model, opt, stats = normalized_and_fused(fn, x, y)
    assert stats["view_regions"] == []
    torch.testing.assert_close(opt(x, y), model(x, y))


@st.composite
def factored(draw):
    """A shape, and another of its element count that splits or merges its dims."""
    primes = draw(st.lists(st.sampled_from([2, 3, 5]), min_size=1, max_size=6))
    cuts_a = sorted(draw(st.sets(st.integers(1, len(primes) - 1), max_size=len(primes) - 1))) if len(primes) > 1 else []
    cuts_b = sorted(draw(st.sets(st.integers(1, len(primes) - 1), max_size=len(primes) - 1))) if len(primes) > 1 else []

    def shape(cuts):
        bounds = [0, *cuts, len(primes)]
        return tuple(math.prod(primes[i:j]) for i, j in zip(bounds, bounds[1:]))
    frame, other = shape(cuts_a), shape(cuts_b)
    kept = draw(st.lists(st.booleans(), min_size=len(frame), max_size=len(frame)))
    value = tuple(s if k else 1 for s, k in zip(frame, kept))
    return frame, other, value[draw(st.integers(0, len(value))):]


@given(factored())
@settings(max_examples=examples(200))
def test_a_value_written_in_another_shape_reads_the_same_elements(case):
    """Broadcast against its frame and read in F's order, a value holds the elements of its
    form broadcast against F: the rewrite's reshapes change nothing a kernel reads."""
    frame, other, shape = case
    fine = refinement([frame, other])
    assert fine is not None and math.prod(fine) == math.prod(frame)
    for target in (fine, other, frame):
        form = written_in(shape, frame, target)
        value = torch.randn(shape) if shape else torch.randn(())
        expected = value.expand(frame).reshape(target)
        if form is None:  # then the value is neither all there nor all broadcast along some dim of target
            assert target is not fine
            continue
        assert torch.equal(value.reshape(form).expand(target), expected)


def test_where_no_kernel_runs_nothing_is_reshaped(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    s, bias, mask = leaves((8, 3, 16, 16), (1, 3, 16, 16), (1, 4, 1, 16, 16))
    _, opt, stats = normalized_and_fused(shifted_window_scores, s, bias, mask)
    assert stats["not_run"] and "view_regions" not in stats and not fused_nodes(opt)  # no region looked for
    assert opt.graphopt_report.runs_at == "any shapes the model takes (torch.fx)"


def test_views_false_keeps_the_graph_running_at_any_shape():
    s, bias, mask = leaves((8, 3, 16, 16), (1, 3, 16, 16), (1, 4, 1, 16, 16))
    model = module(shifted_window_scores, 3)
    opt = graphopt.optimize(model, (s, bias, mask), passes="normalize,fuse{views=false}", verify=True)
    assert opt.graphopt_report.passes[-1].stats["view_regions"] == []
    assert opt.graphopt_report.runs_at == "any shapes the model takes (torch.fx)"


def test_the_default_pipeline_keeps_its_graph_running_at_any_shape(monkeypatch):
    """On CUDA the default pipeline fuses without being asked: its graph stays shape-generic."""
    from graphopt.passes.fuse import Fuse
    monkeypatch.setattr(Fuse, "skip_by_default", lambda self, gm, ctx, pipeline: None)  # as on CUDA
    s, bias, mask = leaves((8, 3, 16, 16), (1, 3, 16, 16), (1, 4, 1, 16, 16))
    opt = graphopt.optimize(module(shifted_window_scores, 3), (s, bias, mask), verify=True)
    fused = next(p for p in opt.graphopt_report.passes if p.name == "fuse")
    assert fused.by_default and fused.stats["view_regions"] == []
    assert opt.graphopt_report.runs_at == "any shapes the model takes (torch.fx)"


def test_a_region_that_joins_nothing_once_its_members_are_chosen_is_not_rewritten():
    """A per-channel scale between reshapes before a batch norm's weight (NFNet's standardized
    weights): the norm does not compute in the scale's shape, so nothing is joined, and the
    graph keeps running at any shape."""
    def fn(m, x, g):
        w = (g.reshape(8) * 0.5).reshape(8)
        return F.batch_norm(x, None, None, weight=w, training=True) * 2.0
    x, g = leaves((1, 8, 6), (8, 1, 1))
    model, opt, stats = normalized_and_fused(fn, x, g)
    assert stats["view_regions"] == []
    assert opt.graphopt_report.runs_at == "any shapes the model takes (torch.fx)"
    assert_same_step(model, opt, (x, g), {}, exact=False)
