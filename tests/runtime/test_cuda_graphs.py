"""optimize(cuda_graphs=True) on CPU: every refusal, the budget's room for what the graphs hold, and
the replay's plumbing (which calls replay, which run uncaptured, a replaced parameter refused)
with torch.cuda.make_graphed_callables stood in for by a CPU replay. The capture itself runs in
`make gpu` (bench/gpu_step_time.py)."""
import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.analysis.cuda_graphs import graphs_reserve, host_syncs
from graphopt.errors import BudgetError, OptionError, UsageError
from graphopt.runtime import cuda_graphs
from graphopt.testing import zoo


def test_an_option_that_is_not_a_bool_is_refused():
    model, args, kwargs = zoo.mlp()
    with pytest.raises(OptionError, match="cuda_graphs must be True or False"):
        graphopt.optimize(model, args, example_kwargs=kwargs, cuda_graphs="yes")


@pytest.mark.parametrize("other, match", [({"stages": 2}, "stages="), ({"shard": "fsdp"}, "FSDP2"),
                                          ({"train": False}, "inference")])
def test_what_no_capture_holds_is_refused_before_tracing(other, match):
    model, args, kwargs = zoo.mlp()
    with pytest.raises(OptionError, match=match):
        graphopt.optimize(model, args, example_kwargs=kwargs, cuda_graphs=True, **other)


def test_the_lazy_form_is_refused():
    model, _, _ = zoo.mlp()
    with pytest.raises(OptionError, match="give example inputs"):
        graphopt.optimize(model, cuda_graphs=True)


class ReadsBack(nn.Module):
    """A forward that reads a value back to the host: its loss scaled by a Python number."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h.sum() / (h.abs().max().item() + 1.0)


def test_a_step_that_waits_on_the_device_is_refused_naming_the_read():
    """graphopt's frontends refuse to trace most such reads (FakeTensors have no values); one in a graph
    that got through (a plain symbolic trace here) is named."""
    gm = torch.fx.symbolic_trace(ReadsBack())
    assert list(host_syncs(gm).values()) == ["item reads a value back to the host"]
    with pytest.raises(UsageError, match=r"item: item reads a value back to the host"):
        cuda_graphs.capture(gm, (torch.randn(4, 8),), {}, None)


def test_a_model_off_cuda_is_refused():
    model, args, kwargs = zoo.mlp()
    with pytest.raises(UsageError, match="needs the model and its example inputs on CUDA"):
        graphopt.optimize(model, args, example_kwargs=kwargs, cuda_graphs=True)


def test_a_segment_that_draws_random_numbers_is_refused():
    model, args, kwargs = zoo.gpt(layers=2)  # dropout in training: its segments draw
    least = _least_budget(model, args, kwargs, cuda_graphs=True)
    with pytest.raises(UsageError, match="draw random numbers"):
        graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=least * 1.02, cuda_graphs=True)


def _least_budget(model, args, kwargs, **options) -> float:
    with pytest.raises(BudgetError) as e:
        graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=1e-6, **options)
    return e.value.min_budget_gb


def test_the_budget_leaves_room_for_the_static_inputs_and_gradients():
    """The least budget with cuda_graphs is the one without, plus what the graphs hold beyond the step."""
    model, args, kwargs = zoo.mlp()
    traced = graphopt.trace(model, args, kwargs)
    held = graphs_reserve(traced, list(args) + list(kwargs.values()))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held == grads + sum(t.numel() * t.element_size() for t in (*args, *kwargs.values()))
    without, with_graphs = _least_budget(model, args, kwargs), _least_budget(model, args, kwargs, cuda_graphs=True)
    assert with_graphs * 1e9 == pytest.approx(without * 1e9 + held, abs=2e3)


class _Replay:
    """make_graphed_callables on CPU: the module's forward, run as it is, its calls counted."""

    calls = 0

    def __init__(self, module, sample_args, num_warmup_iters):
        self.module = module
        module(*sample_args)  # the warm-up, whose effects trial_run puts back

    def forward(self, *tensors):
        _Replay.calls += 1
        return self.module(*tensors)


def test_calls_of_the_captured_signature_replay_and_others_run_uncaptured(monkeypatch):
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", _Replay)
    _, args, kwargs = zoo.gpt(layers=1)
    model = zoo.GPT(layers=1, dropout=0.0)  # no draws: the replay's results equal the uncaptured graph's
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, passes="normalize,cse,dce", frontend="fx")
    reference = graphopt.optimize(model, args, example_kwargs=kwargs, train=True, passes="normalize,cse,dce",
                                  frontend="fx")
    cuda_graphs.install_cuda_graphs(opt, args, kwargs)
    before = _Replay.calls
    loss = opt(*args, **kwargs).loss
    assert _Replay.calls == before + 1
    torch.testing.assert_close(loss, reference(*args, **kwargs).loss)
    shorter = tuple(a[:, :16].contiguous() for a in args), {k: v[:, :16].contiguous() for k, v in kwargs.items()}
    opt(*shorter[0], **shorter[1])  # another signature: the graph as it is
    with torch.no_grad():
        opt(*args, **kwargs)  # no backward to replay
    assert _Replay.calls == before + 1
    with torch.no_grad():
        model.head.weight = nn.Parameter(model.head.weight.clone())
    with pytest.raises(UsageError, match="'weight' has been replaced or moved"):
        opt(*args, **kwargs)
