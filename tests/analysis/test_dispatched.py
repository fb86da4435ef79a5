"""What a call the registry does not list may do, from the ATen operators it dispatches, under
torch.fx as under torch.export (analysis/dispatched.py): the facts cse, dce and recompute ask."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.analysis.dispatched import dispatched
from graphopt.analysis.effects import state_effect
from graphopt.passes.recompute.rewrite import recomputable


class Rotary(nn.Module):
    """torchtitan's attention inputs: rotary as complex numbers, KV heads by repeat_interleave."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(16, 16, bias=False), nn.Linear(16, 8, bias=False)
        angles = torch.outer(torch.arange(8.0), 1.0 / 10000 ** (torch.arange(0, 4, 2) / 4))
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k = self.q(x).view(b, s, 4, 4), self.k(x).view(b, s, 2, 4)
        qc = torch.view_as_complex(q.float().reshape(b, s, 4, 2, 2))
        kc = torch.view_as_complex(k.float().reshape(b, s, 2, 2, 2))
        freqs = self.freqs[:s].view(1, s, 1, 2)
        q = torch.view_as_real(qc * freqs).flatten(3)
        k = torch.repeat_interleave(torch.view_as_real(kc * freqs).flatten(3), dim=2, repeats=2)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2),
                                              is_causal=True).sum()


def _calls(gm, name):
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and name in str(n.target)]


def test_complex_rotary_and_repeat_interleave_rerun_under_fx():
    model, x = Rotary(), torch.randn(2, 8, 16)
    gm = graphopt.trace(model, (x,), frontend="fx")
    calls = [n for name in ("view_as_complex", "view_as_real", "repeat_interleave") for n in _calls(gm, name)]
    assert len(calls) == 5
    for node in calls:
        facts = dispatched(node)
        assert facts is not None and facts.writes is None and facts.draws is None, node
        assert state_effect(node, gm) is None and recomputable(node, gm) is None, node
    assert any("aten.view_as_complex" in op for op in dispatched(calls[0]).ops)


@torch.fx.wrap
def _counted(x, count):
    count.add_(1)
    return x * 2


@torch.fx.wrap
def _noised(x):
    return x + torch.rand_like(x)


class Effects(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        h = self.linear(x)
        return (_counted(h, self.count) + _noised(h)).sum()


def test_a_call_that_writes_or_draws_is_named_by_the_operator_that_does():
    gm = graphopt.trace(Effects(), (torch.randn(3, 4),), frontend="fx")
    (counted,) = _calls(gm, "_counted")
    (noised,) = _calls(gm, "_noised")
    assert recomputable(counted, gm) == "opaque call: it dispatches aten.add_.Tensor writes self"
    assert recomputable(noised, gm) == "opaque call: it dispatches aten.rand_like.default, which draws random numbers"


def test_a_call_that_writes_survives_dead_code_elimination():
    model = Effects()
    opt = graphopt.optimize(model, (torch.randn(3, 4),), passes="dce", frontend="fx")
    opt(torch.randn(3, 4))
    assert float(model.count) == 1.0 and _calls(opt, "_counted")


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_the_rotary_model_checkpoints_across_its_complex_ops(frontend):
    model, x = Rotary(), torch.randn(2, 8, 16)
    gm = graphopt.trace(model, (x,), frontend=frontend)
    stuck = [n.name for n in gm.graph.nodes if n.op == "call_function" and recomputable(n, gm) is not None]
    assert stuck == [], stuck
