"""A model's own torch.autograd.Functions keep their backward through both frontends
(graphopt/frontend/custom_functions.py), on the example batch and on another one."""
import copy

import pytest
import torch

import graphopt
from graphopt.frontend.custom_functions import FunctionCall
from graphopt.passes.recompute.rewrite import recomputable


class RoundThrough(torch.autograd.Function):
    """A straight-through estimator: round forward, identity backward (round's own gradient is 0)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class TanhGelu(torch.autograd.Function):
    """BLOOM's GeLUFunction: saves its input only; its forward's ops would save five tensors."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return g * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class ScaleBoth(torch.autograd.Function):
    """Two tensors and a constant in, a tuple with a None out; the scale's gradient is doubled."""

    @staticmethod
    def forward(ctx, a, b, scale):
        ctx.scale = scale
        return a * scale, None, b * scale

    @staticmethod
    def backward(ctx, ga, _, gb):
        return 2 * ga * ctx.scale, gb * ctx.scale, None


class AddOneInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.add_(1)

    @staticmethod
    def backward(ctx, g):
        return g


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        h = TanhGelu.apply(self.a(x))
        p, _, q = ScaleBoth.apply(h, h.tanh(), 3.0)
        return (RoundThrough.apply(self.b(p + q) * 4) * x).sum()


def _grads(module, model, x):
    for p in model.parameters():
        p.grad = None
    loss = module(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_functions_keep_their_backward_on_every_batch(frontend):
    torch.manual_seed(0)
    model, x = Model(), torch.randn(4, 8)
    opt = graphopt.optimize(model, (x,), frontend=frontend)
    assert sum(isinstance(n.target, FunctionCall) for n in opt.graph.nodes) == 3
    assert torch.autograd.Function.apply.__func__ is torch.autograd.function.Function.__dict__["apply"].__func__
    for batch in (x, torch.randn(4, 8)):
        want_loss, want = _grads(model, model, batch)
        got_loss, got = _grads(opt, model, batch)
        assert torch.equal(got_loss, want_loss)
        for g, w in zip(got, want):
            assert torch.equal(g, w)  # round's own gradient would make the first layer's zero


def test_a_function_that_saves_less_keeps_less_and_may_be_recomputed(monkeypatch):
    torch.manual_seed(0)
    model, x = Model(), torch.randn(64, 8)
    gm = graphopt.trace(model, (x,), frontend="export")
    gelu = next(n for n in gm.graph.nodes if isinstance(n.target, FunctionCall) and n.target.function is TanhGelu)
    assert recomputable(gelu, gm) is None
    inlined = copy.deepcopy(model)
    from graphopt.runtime.step import step_peak
    kept = step_peak(graphopt.optimize(model, (x,), frontend="export"), model, (x,))
    # the same model with its Functions traced through: autograd saves what the forward's ops save
    from graphopt.frontend import custom_functions
    monkeypatch.setattr(custom_functions, "_kept", lambda function: False)
    through = step_peak(graphopt.optimize(inlined, (x,), frontend="export"), inlined, (x,))
    assert kept < through


def test_a_function_that_writes_its_input_is_not_recomputed():
    class Writes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)

        def forward(self, x):
            return AddOneInPlace.apply(self.a(x) * 2).sum()

    model, x = Writes(), torch.randn(4, 8)
    gm = graphopt.trace(model, (x,), frontend="export")
    call = next(n for n in gm.graph.nodes if isinstance(n.target, FunctionCall))
    assert "writes one of its inputs in place" in recomputable(call, gm)
    opt = graphopt.optimize(model, (x,), frontend="export")
    want_loss, want = _grads(model, model, x)
    got_loss, got = _grads(opt, model, x)
    assert torch.equal(got_loss, want_loss) and all(torch.equal(g, w) for g, w in zip(got, want))
