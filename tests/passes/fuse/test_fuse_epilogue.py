"""A linear's or convolution's bias add taken over by the fused group after it: the activation
between two matmuls becomes a group of two, the matmul runs without its bias, the group's
backward forms the bias's gradient; never where it would only join adds (which pass their
gradient through), never closing a cycle through the matmul."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_same_step, plain_and_fused_peaks
from test_fuse import fuse, fused_nodes, group_nodes, module

import graphopt
from graphopt.passes.notes import notes

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def mlp(m, x):
    return m.l2(F.gelu(m.l1(x)))


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_the_gelu_between_two_linears_takes_over_the_first_ones_bias(frontend):
    model = module(mlp, 1, l1=nn.Linear(24, 40), l2=nn.Linear(40, 24))
    x = torch.randn(3, 5, 24, requires_grad=True)
    opt = graphopt.optimize(model, (x,), passes="fuse", frontend=frontend, verify=True)
    stats = opt.graphopt_report.passes[-1].stats
    assert [g["ops"] for g in stats["groups"]] == [["add", "gelu"]]
    (call,) = fused_nodes(opt)
    matmul = call.args[0]
    assert matmul.args[2] is None and notes(matmul)["fuse"] == "its bias is added by the group after it"
    assert_same_step(model, opt, (x,), {}, exact=False)


def test_a_convolution_hands_its_per_channel_bias_to_the_activation_after_it():
    def fn(m, x):
        return m.c2(F.silu(m.c1(x)) * 1.5)
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    model, opt, stats = fuse(fn, x, c1=nn.Conv2d(3, 8, 3, padding=1), c2=nn.Conv2d(8, 4, 3, stride=2))
    assert group_nodes(stats) == [["c1", "silu", "mul"]]
    (call,) = fused_nodes(opt)
    assert call.args[0].args[2:] == (None, (1, 1), (1, 1), (1, 1), 1)
    assert_same_step(model, opt, (x,), {}, exact=False)


def test_a_bias_add_that_would_join_only_adds_stays_in_its_matmul():
    model, opt, stats = fuse(lambda m, x: (m.l(x) + x).relu().sum(), torch.randn(4, 16, requires_grad=True),
                             l=nn.Linear(16, 16))
    assert group_nodes(stats) == [["add", "relu"]]
    assert stats["groups"][0]["not_fused"]["l"] == ("its bias add would join only add, which passes the gradient "
                                                     "through: it stays in the matmul")


def test_a_bias_add_before_a_cast_alone_stays_in_its_matmul():
    """HF's logits.float(): a no-op cast returns the logits themselves; a group would store a copy."""
    model, opt, stats = fuse(lambda m, x: m.head(x).float() * 1.0, torch.randn(4, 16, requires_grad=True),
                             head=nn.Linear(16, 32))
    assert all("head" not in g["nodes"] for g in stats["groups"])


def test_a_group_never_takes_a_bias_whose_matmul_reads_it():
    """y = gelu(l1(x)); tanh(l2(y)) * y: l2's group may not hold gelu, which l2's matmul reads."""
    def fn(m, x):
        y = F.gelu(m.l1(x))
        return torch.tanh(m.l2(y)) * y
    x = torch.randn(6, 16, requires_grad=True)
    model, opt, stats = fuse(fn, x, l1=nn.Linear(16, 16), l2=nn.Linear(16, 16))
    assert group_nodes(stats) == [["l1", "gelu"], ["l2", "tanh", "mul"]]
    assert stats["groups"][1]["not_fused"]["gelu"] == "l2's matmul reads it, and runs before the kernel that adds its bias"
    assert_same_step(model, opt, (x,), {}, exact=False)



def test_the_fused_step_keeps_no_more_than_eager_and_the_estimate_sees_it():
    model = module(lambda m, x: mlp(m, x).sum(), 1, l1=nn.Linear(64, 256), l2=nn.Linear(256, 64))
    args = (torch.randn(128, 64, requires_grad=True),)
    opt, peaks = plain_and_fused_peaks(model, args)
    assert len(fused_nodes(opt)) == 1
    # the same full-size tensors; the bias's gradient passes through per-program column sums: a few
    # vectors of its size more at the backward's peak
    assert peaks["fused"] <= peaks["plain"] + 4 * 256 * 4


def squeeze_excite(m, x):
    return x * torch.sigmoid(m.expand(m.act(m.reduce(x.mean((2, 3), keepdim=True)))))


def test_a_squeeze_excite_convolution_before_a_relu_keeps_its_bias():
    """On a 1x1 map each value scales a channel of the block: a ReLU flipped at a tie by the
    group's rounding would move a channel's gradient (RegNetY). Before the sigmoid, which joins
    the product after it, the add would save nothing: the bias stays in the convolution too."""
    x = torch.randn(2, 8, 5, 5, requires_grad=True)
    model, opt, stats = fuse(squeeze_excite, x, reduce=nn.Conv2d(8, 4, 1), act=nn.ReLU(), expand=nn.Conv2d(4, 8, 1))
    assert group_nodes(stats) == [["sigmoid", "mul"]]
    assert_same_step(model, opt, (x,), {}, exact=False)


def test_a_squeeze_excite_convolution_before_a_silu_gives_its_bias_to_the_group():
    """EfficientNet's squeeze-excite: the SiLU between the two 1x1 convolutions is a group of two."""
    x = torch.randn(2, 8, 5, 5, requires_grad=True)
    model, opt, stats = fuse(squeeze_excite, x, reduce=nn.Conv2d(8, 4, 1), act=nn.SiLU(), expand=nn.Conv2d(4, 8, 1))
    assert group_nodes(stats) == [["reduce", "act"], ["sigmoid", "mul"]]
    assert_same_step(model, opt, (x,), {}, exact=False)
