import pytest
import torch
import torch.nn.functional as F

import graphopt
from graphopt.analysis.memory import GB, measure_peak
from graphopt.runtime.step import step_peak
from graphopt.testing import zoo


def test_the_peak_is_step_peaks():
    model, args, kwargs = zoo.gpt(batch=4, seq=32)
    measured = graphopt.measure_step(model, args, kwargs)
    assert isinstance(measured, graphopt.StepMeasure)
    assert measured.peak_bytes == step_peak(model, model, args, kwargs)
    # the peak counts the parameters, as budget_gb does
    assert measured.peak_bytes > sum(p.numel() * p.element_size() for p in model.parameters())
    assert measured.peak_gb == measured.peak_bytes / GB and measured.step_ms > 0
    assert "MB" in str(measured) and "ms" in str(measured)


class WithLoss(torch.nn.Module):
    """An MLP whose output is its scalar loss."""

    def __init__(self):
        super().__init__()
        self.mlp = zoo.MLP(width=128, depth=4)

    def forward(self, x, y):
        return F.cross_entropy(self.mlp(x), y)


def test_an_optimized_graph_measured_under_its_budget():
    model, args = WithLoss().train(), (torch.randn(1024, 128), torch.randint(0, 10, (1024,)))
    eager = graphopt.measure_step(model, args)
    fixed = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget_gb = (fixed + 0.5 * (eager.peak_bytes - fixed)) / GB
    opt = graphopt.optimize(model, args, budget_gb=budget_gb)
    measured = graphopt.measure_step(opt, args)
    assert measured.peak_bytes == step_peak(opt, model, args)
    assert measured.peak_gb <= budget_gb < eager.peak_gb


def test_a_lazy_graph_is_measured_after_it_is_built():
    model, args, kwargs = zoo.gpt(batch=4, seq=32)
    lazy = graphopt.optimize(model)
    measured = graphopt.measure_step(lazy, args, kwargs)
    assert lazy.graph_module is not None
    assert measured.peak_bytes == step_peak(lazy.graph_module, model, args, kwargs)


def test_measuring_trains_nothing():
    model, args, _ = zoo.convnet(batch=4)
    model.train()
    target = torch.randint(0, 10, (4,))
    model.fc.weight.grad = torch.ones_like(model.fc.weight)
    grad = model.fc.weight.grad
    stats = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    graphopt.measure_step(model, args, loss_fn=lambda out, x: F.cross_entropy(out, target))
    assert model.fc.weight.grad is grad and bool((grad == 1).all())
    assert all(torch.equal(b, stats[name]) for name, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)


def test_an_output_without_a_loss_needs_loss_fn():
    model, (x,), _ = zoo.mlp()
    with pytest.raises(graphopt.UsageError, match=r"loss_fn="):
        graphopt.measure_step(model, (x,))
    loss_fn = lambda out, x: out.pow(2).mean()  # noqa: E731
    measured = graphopt.measure_step(model, x, loss_fn=loss_fn)  # one tensor stands for (x,)
    assert measured.peak_bytes == step_peak(model, model, (x,), None, loss_fn)


@pytest.mark.parametrize("call, words", [
    (lambda m, x: graphopt.measure_step(lambda x: x, (x,)), "torch.nn.Module"),
    (lambda m, x: graphopt.measure_step(m, [[x]].__iter__()), "tuple of forward"),
    (lambda m, x: graphopt.measure_step(m, (x,), [x]), "dict of forward"),
    (lambda m, x: graphopt.measure_step(m, (x,), repeats=0), "1 or more"),
])
def test_bad_arguments_say_what_to_give(call, words):
    model, (x,), _ = zoo.mlp()
    with pytest.raises(graphopt.UsageError, match=words):
        call(model, x)


def test_an_unknown_optimizer_names_the_known_ones():
    model, (x,), _ = zoo.mlp()
    with pytest.raises(graphopt.OptionError, match="measure_step's optimizer must be .*adamw"):
        graphopt.measure_step(model, (x,), loss_fn=lambda out, x: out.sum(), optimizer="lion")


def _loop_peak(module, model, optimizer, args, kwargs) -> int:
    """A training loop's step (forward, loss, backward, optimizer.step()) measured from its second
    on, the optimizer's state resident, then everything put back."""
    saved = [p.detach().clone() for p in model.parameters()]

    def loop_step():
        module(*args, **kwargs).loss.backward()
        optimizer.step()

    loop_step()  # the state exists from the first step on
    for p in model.parameters():
        p.grad = None
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    try:
        return measure_peak(loop_step, model, *args, *kwargs.values(), *state)
    finally:
        optimizer.state.clear()
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved):
                p.copy_(s)
                p.grad = None


def test_with_an_optimizer_the_peak_is_a_training_loops_and_yours_stays_untouched():
    model, args, kwargs = zoo.gpt(batch=4, seq=32)
    optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    measured = graphopt.measure_step(model, args, kwargs, optimizer=optimizer)
    assert not optimizer.state and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert measured.peak_bytes == _loop_peak(model, model, optimizer, args, kwargs)
    # AdamW's two moments are resident: more than the step without it by at least their bytes
    moments = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    assert measured.peak_bytes >= graphopt.measure_step(model, args, kwargs).peak_bytes + moments
    assert graphopt.measure_step(model, args, kwargs, optimizer="adamw").peak_bytes == measured.peak_bytes


def test_a_budget_with_an_optimizer_is_measured_as_it_was_planned():
    """The README's quickstart with AdamW: a budget below the step's peak with the optimizer in it,
    from measure_step(optimizer=), which optimize(optimizer=) holds and predicts."""
    model, args, kwargs = zoo.gpt(batch=8, seq=64, layers=4)
    optimizer = torch.optim.AdamW(model.parameters())
    before = graphopt.measure_step(model, args, kwargs, optimizer=optimizer)
    opt = graphopt.optimize(model, args, kwargs, budget_gb=0.8 * before.peak_gb, optimizer=optimizer)
    measured = graphopt.measure_step(opt, args, kwargs, optimizer=optimizer)
    assert measured.peak_bytes <= 0.8 * before.peak_bytes
    assert abs(opt.graphopt_report.passes[-1].peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes


@pytest.mark.filterwarnings("ignore::graphopt.MicrobatchWarning")
def test_a_train_step_is_measured_as_its_call():
    model, args, kwargs = zoo.gpt(batch=8, seq=32)
    eager = graphopt.measure_step(model, args, kwargs)
    fixed = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = fixed + 0.3 * (eager.peak_bytes - fixed)
    step = graphopt.train_step(model, args, kwargs, budget_gb=budget / GB)
    assert step.microbatches > 1
    measured = graphopt.measure_step(step, args, kwargs)
    assert all(p.grad is None for p in model.parameters())
    assert measured.peak_bytes <= budget
    assert measured.peak_bytes == measure_peak(lambda: step(*args, **kwargs), model, *args, *kwargs.values())
    with pytest.raises(graphopt.UsageError, match="loss_fn out"):
        graphopt.measure_step(step, args, kwargs, loss_fn=lambda out, *a, **k: out.loss)
