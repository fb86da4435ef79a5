"""graphopt.ops.flops: each op's floating-point operations from its shapes."""
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from graphopt.analysis import fake_kernels
from graphopt.ops import flops
from op_cases import randn, seeded  # seeded: an autouse fixture, seeds GEN per test

aten = torch.ops.aten


def exported(module, *args):
    return torch.export.export(module, args, strict=False).module()


def node_of(gm, target):
    return next(n for n in gm.graph.nodes if n.target == target)


def test_flops():
    gm = exported(nn.Linear(16, 32), randn(2, 8, 16))
    assert flops(node_of(gm, aten.linear.default)) == 2 * (2 * 8) * 32 * 16

    class Bmm(nn.Module):
        def forward(self, a, b):
            return torch.bmm(a, b).relu().view(-1)

    gm = exported(Bmm(), randn(4, 5, 6), randn(4, 6, 7))
    assert flops(node_of(gm, aten.bmm.default)) == 2 * 4 * 5 * 7 * 6
    assert flops(node_of(gm, aten.relu.default)) == 4 * 5 * 7
    assert flops(node_of(gm, aten.view.default)) == 0

    gm = exported(nn.Conv2d(4, 8, 3, groups=2), randn(2, 4, 10, 10))
    assert flops(node_of(gm, aten.conv2d.default)) == 2 * (2 * 8 * 8 * 8) * (4 // 2 * 3 * 3)

    class Attention(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    gm = exported(Attention(), randn(2, 4, 8, 16), randn(2, 4, 10, 16), randn(2, 4, 10, 16))
    B, H, Lq, Lk, D = 2, 4, 8, 10, 16
    assert flops(node_of(gm, aten.scaled_dot_product_attention.default)) == 4 * B * H * Lq * Lk * D + 5 * B * H * Lq * Lk

    class Pools(nn.Module):
        def forward(self, x):
            return F.max_pool2d(x, 3, 2, 1), F.avg_pool2d(x, 2), F.max_pool1d(x[0], 3)

    gm = exported(Pools(), randn(2, 4, 8, 8))
    pools = [n for n in gm.graph.nodes if "pool" in str(n.target)]
    # one FLOP per window element of each output: a 3x3 pool reads its input about nine times
    assert [flops(n) for n in pools] == [2 * 4 * 4 * 4 * 9, 2 * 4 * 4 * 4 * 4, 4 * 8 * 2 * 3]

    class Experts(nn.Module):  # a MoE layer's grouped matmuls: 32 rows in 3 groups (the second empty)
        def forward(self, x, w, g, offs):
            return torch._grouped_mm(x, w, offs=offs), torch._grouped_mm(x.t(), g, offs=offs)

    offs = torch.tensor([8, 8, 32], dtype=torch.int32)
    with fake_kernels.active():  # torch's own fake takes bfloat16 only
        gm = exported(Experts(), randn(32, 16), randn(3, 24, 16).transpose(-2, -1), randn(32, 24), offs)
    forward, weight_grad = [n for n in gm.graph.nodes if n.target == aten._grouped_mm.default]
    assert flops(forward) == 2 * 32 * 24 * 16       # each row times its group's 16 x 24 matrix
    assert flops(weight_grad) == 2 * 16 * 24 * 32   # each group's rows contracted once: 32 rows in all

    traced = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(16, 32), nn.ReLU()))
    assert all(flops(n, traced) == 0 for n in traced.graph.nodes)  # no meta: 0, no exception
    FakeTensorProp(traced, FakeTensorMode(allow_non_fake_inputs=True)).propagate(randn(3, 16))
    assert [flops(n, traced) for n in traced.graph.nodes if n.op == "call_module"] == [2 * 3 * 32 * 16, 3 * 32]
