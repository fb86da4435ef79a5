"""The memory model against a measured CPU step (the bytes of live tensor storages)."""
import pytest
import torch

import graphopt
from graphopt.analysis.memory import GB, estimate_peak, measure_step
from graphopt.analysis.saved import saved_tensors
from graphopt.testing import zoo
from graphopt.frontend.graph_inputs import placeholder_values

# Sized so activations dominate parameters.
SIZED = {
    "mlp": lambda: zoo.mlp(batch=512, width=256, depth=4),
    "convnet": lambda: zoo.convnet(batch=16, size=32, blocks=6),
    "gpt": lambda: zoo.gpt(batch=8, seq=64, layers=2),
    "two_heads": lambda: zoo.two_heads("dataclass", batch=2048, dim=64),
}


@pytest.mark.parametrize("name", SIZED)
def test_estimate_within_ten_percent_ofmeasure_step(name):
    model, args, kwargs = SIZED[name]()
    gm = graphopt.trace(model, args, kwargs)
    estimate = estimate_peak(gm, placeholder_values(gm, args, kwargs))
    measured = measure_step(gm, args, kwargs)
    assert abs(estimate.peak_bytes - measured) <= 0.10 * measured, (estimate.peak_bytes, measured)
    assert estimate.breakdown["activations"] > estimate.breakdown["parameters"]
    assert estimate.peak_gb == estimate.peak_bytes / GB


def test_saved_tensors_are_attributed():
    model, args, kwargs = zoo.gpt(layers=1)
    gm = graphopt.trace(model, args, kwargs)
    saved = saved_tensors(gm, placeholder_values(gm, args, kwargs))
    fc = saved["blocks_0_fc"]  # nn.Linear saves its input and its weight
    assert {(s.source, s.owner) for s in fc} == {("node", "blocks_0_ln2"), ("state", "blocks.0.fc.weight")}
    ln = saved["blocks_0_ln1"]  # LayerNorm: its input, weight and bias, and mean/rstd made inside
    assert sum(s.source == "internal" for s in ln) == 2
    assert all(s.source != "internal" for s in saved["gelu"])  # gelu saves its input, a node output


def test_relu_saving_its_result_is_not_counted_twice():
    model, args, kwargs = zoo.convnet()
    gm = graphopt.trace(model, args, kwargs)
    saved = saved_tensors(gm, placeholder_values(gm, args, kwargs))
    assert [(s.source, s.owner) for s in saved["relu"]] == [("node", "relu")]


def test_policy_calls_are_the_calls_a_selective_checkpoint_policy_sees():
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from graphopt.analysis.saved import record_step
    from graphopt.runtime.checkpoint import batch_norm_once

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(4)

        def forward(self, x):
            y = torch.relu(self.fc(x))  # a linear on a 3-d input: a view, the weight's t, addmm, a view
            return batch_norm_once(y, self.bn.weight, self.bn.bias, self.bn.running_mean, self.bn.running_var, 0.1, 1e-5)

    block, x = Block(), torch.randn(2, 4, 8, requires_grad=True)
    seen = []

    def policy(ctx, op, *args, **kwargs):
        if not ctx.is_recompute:
            seen.append(op)
        return CheckpointPolicy.PREFER_RECOMPUTE

    checkpoint(block, x, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(policy)).sum().backward()
    graph = torch.fx.Graph()  # the block as a rewritten segment holds it: batch_norm_once one call
    y = graph.call_function(torch.relu, (graph.call_module("fc", (graph.placeholder("x"),)),))
    state = [graph.get_attr(f"bn.{name}") for name in ("weight", "bias", "running_mean", "running_var")]
    graph.output(graph.call_function(batch_norm_once, (y, *state, 0.1, 1e-5)))
    calls = record_step(torch.fx.GraphModule(block, graph), [x.detach()]).policy_calls
    assert sum(calls.values()) == len(seen)
    assert calls["fc"] == 4 and calls["relu"] == 1 and calls["batch_norm_once"] > 4  # copies of the statistics


def test_estimate_allocates_nothing_on_meta_models():
    with torch.device("meta"):
        big = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(4)])
    x = torch.empty(4096, 8192, device="meta")
    gm = graphopt.trace(big, (x,))
    estimate = estimate_peak(gm, [x])
    assert estimate.breakdown["parameters"] == sum(p.numel() * 4 for p in big.parameters())
    assert estimate.peak_bytes > 4 * 4096 * 8192 * 4  # four saved activations at least


@pytest.mark.parametrize("selective", [False, True])
@pytest.mark.parametrize("layers", [2, 4])
def test_estimate_follows_recompute_segments(layers, selective):
    from graphopt.passes.recompute.rewrite import checkpoint_segments
    from graphopt.frontend.trace import annotate

    model, args, kwargs = zoo.gpt(batch=8, seq=64, layers=layers)
    plain = graphopt.trace(model, args, kwargs)
    gm = graphopt.trace(model, args, kwargs)
    gm = checkpoint_segments(gm, zoo.block_segments(gm), [selective] * layers)
    annotate(gm, placeholder_values(gm, args, kwargs))
    estimate = estimate_peak(gm, placeholder_values(gm, args, kwargs))
    measured = measure_step(gm, args, kwargs)
    assert abs(estimate.peak_bytes - measured) <= 0.10 * measured, (estimate.peak_bytes, measured)
    assert estimate.breakdown.get("recomputed", 0) > 0
    assert estimate.peak_bytes < estimate_peak(plain, placeholder_values(plain, args, kwargs)).peak_bytes


# ---------------------------------------------------------------- the optimizer in the budget

def _real_optimizer_memory(model, optimizer):
    """State bytes and step temporaries of a real second step() (the first makes the state)."""
    from graphopt.analysis.live_storage import LiveStorage

    saved = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    resident = [*model.parameters(), *(p.grad for p in model.parameters()), *state]
    with LiveStorage(resident) as live:
        optimizer.step()
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
            p.grad = None
    optimizer.state.clear()
    return sum(t.untyped_storage().nbytes() for t in state), live.peak - live.live


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, weight_decay=0.1),  # weight decay copies every gradient
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam([{"params": list(ps)[:2], "lr": 1e-3}, {"params": list(ps)[2:]}]),
], ids=["adamw", "adam-decay", "sgd-momentum", "adam-groups"])
def test_optimizer_state_and_step_are_measured_as_a_real_step_makes_them(make):
    from graphopt.analysis.optimizer_memory import optimizer_memory

    model, _, _ = zoo.mlp(batch=8, width=128, depth=3)
    optimizer = make(model.parameters())
    predicted = optimizer_memory(optimizer, list(model.parameters()))
    assert (predicted.state_bytes, predicted.step_bytes) == _real_optimizer_memory(model, optimizer)
    assert not optimizer.state  # measuring it did not step the user's optimizer


def test_a_budget_with_an_optimizer_holds_for_the_whole_loop():
    model, args, kwargs = zoo.gpt(batch=8, seq=64, layers=4)
    optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    plain = graphopt.trace(model, args, kwargs)
    without = estimate_peak(plain, placeholder_values(plain, args, kwargs))
    budget_gb = (without.peak_bytes * 0.8) / GB
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=budget_gb, optimizer=optimizer)
    predicted = opt.graphopt_report.passes[-1].peak_bytes
    assert "AdamW" in opt.graphopt_report.passes[-1].name

    def loop_step():
        opt(*args, **kwargs).loss.backward()
        optimizer.step()

    from graphopt.analysis.memory import measure_peak

    saved = [p.detach().clone() for p in model.parameters()]
    loop_step()  # the state exists from the first step on
    for p in model.parameters():
        p.grad = None
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    measured = measure_peak(loop_step, opt, *args, *kwargs.values(), *state)
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
            p.grad = None
    assert measured <= budget_gb * GB
    assert abs(predicted - measured) <= 0.01 * measured


@pytest.mark.parametrize("name", SIZED)
@pytest.mark.parametrize("accumulate", [False, True])
def test_the_estimate_takes_gradients_as_asked_not_as_they_are(name, accumulate):
    """With accumulate every .grad is resident and backward adds into it, as the real step with
    .grad present does; without, none is, whatever .grad the parameters hold when planning."""
    model, args, kwargs = SIZED[name]()
    gm = graphopt.trace(model, args, kwargs)
    inputs = placeholder_values(gm, args, kwargs)
    clean = estimate_peak(gm, inputs, accumulate=accumulate).peak_bytes
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert estimate_peak(gm, inputs, accumulate=accumulate).peak_bytes == clean
    assert all(p.grad is not None and bool((p.grad == 1).all()) for p in model.parameters())
    measured = measure_step(gm, args, kwargs, accumulate=accumulate)
    assert all(p.grad is None for p in model.parameters())
    assert abs(clean - measured) <= 0.10 * measured, (clean, measured)


def test_accumulated_gradients_are_resident_from_the_start():
    model, args, kwargs = SIZED["mlp"]()
    gm = graphopt.trace(model, args, kwargs)
    inputs = placeholder_values(gm, args, kwargs)
    grads = 4 * sum(p.numel() for p in model.parameters())
    fresh, accumulated = (estimate_peak(gm, inputs, accumulate=a) for a in (False, True))
    assert accumulated.breakdown["parameter gradients"] == grads
    assert accumulated.peak_bytes > fresh.peak_bytes
    assert accumulated.peak_bytes == measure_step(gm, args, kwargs, accumulate=True)


def test_a_budget_for_accumulation_holds_where_a_plain_one_does_not():
    """optimize(accumulate=True) plans for the step of a microbatch after the first; a plan made
    for .grad None overshoots its budget there."""
    model, args, kwargs = zoo.mlp(batch=512, width=256, depth=6)
    gm = graphopt.trace(model, args, kwargs)
    inputs = placeholder_values(gm, args, kwargs)
    plain = estimate_peak(gm, inputs).peak_bytes
    budget = 0.85 * plain
    fresh = graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=budget / GB)
    accumulated = graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=budget / GB, accumulate=True)
    assert "accumulate=True" in accumulated.graphopt_report.passes[-1].name
    assert measure_step(fresh, args, kwargs, accumulate=True) > budget
    assert measure_step(accumulated, args, kwargs, accumulate=True) <= budget
