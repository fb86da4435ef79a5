"""Offloaded segments (runtime/offload.py): a recompute segment whose inputs wait on the host until
its backward. The same step as eager, bit for bit, dropout included; the device holds less than
with the inputs kept, and the estimate counts what the device holds, to the byte, as measured."""
import copy

import pytest
import torch

import graphopt
from graphopt.analysis.blocks import outer_blocks
from graphopt.analysis.live_storage import LiveStorage
from graphopt.analysis.memory import estimate_peak, measure_step
from graphopt.frontend.graph_inputs import placeholder_values
from graphopt.analysis.offload_time import offload_time, offloaded_bytes
from graphopt.passes.recompute.rewrite import checkpoint_segments, inline_segments
from graphopt.analysis.segments import SegmentCall
from graphopt.runtime import offload
from graphopt.runtime.offload import OffloadedSegment, owned
from graphopt.testing import zoo

from conftest import assert_same_step


def _gpt(offload: bool | None, layers=4):
    torch.manual_seed(0)
    model, args, kwargs = zoo.gpt(batch=8, seq=64, layers=layers)  # dropout in every block
    gm = graphopt.trace(model, args, kwargs)
    if offload is not None:
        gm = checkpoint_segments(gm, zoo.block_segments(gm), offload=offload)
    return model, gm, args, kwargs


def test_the_step_is_eager_s_bit_for_bit_with_dropout_on_another_batch():
    model, gm, args, kwargs = _gpt(offload=True)
    assert [n.target.draws for n in gm.graph.nodes if isinstance(n.target, OffloadedSegment)] == [True] * 4
    idx = torch.randint(0, 256, args[0].shape)  # not the example
    assert_same_step(model, gm, (idx,), {"targets": torch.randint(0, 256, idx.shape)}, exact=True)


def _held_after_forward(gm, args, kwargs) -> int:
    """Device bytes the step holds between its forward and its backward, beyond its parameters."""
    with LiveStorage() as live:
        loss = gm(*args, **kwargs).loss
    held = live.live
    loss.backward()
    return held


def test_between_forward_and_backward_the_inputs_are_the_host_s_and_the_estimate_is_the_measurement():
    _, kept, args, kwargs = _gpt(offload=False)
    _, moved, _, _ = _gpt(offload=True)
    assert _held_after_forward(kept, args, kwargs) - _held_after_forward(moved, args, kwargs) == \
        offloaded_bytes(moved) == 4 * 8 * 64 * 64 * 4  # each block's input: batch x sequence x width, float32
    estimated = estimate_peak(moved, placeholder_values(moved, args, kwargs)).peak_bytes
    assert estimated == measure_step(moved, args, kwargs)


def test_undone_it_is_the_graph_it_was():
    model, gm, args, kwargs = _gpt(offload=True, layers=2)
    inline_segments(gm)
    assert not any(isinstance(n.target, OffloadedSegment) for n in gm.graph.nodes)
    assert_same_step(model, gm, args, kwargs, exact=True)


def test_a_segment_returning_a_model_s_output_stays_a_checkpoint():
    # the tail makes GPTOutput, a dataclass: autograd would not see the loss inside it
    model, args, kwargs = zoo.gpt(batch=2, seq=16, layers=2)
    gm = graphopt.trace(model, args, kwargs)
    nodes = list(gm.graph.nodes)
    tail = nodes[[n.name for n in nodes].index("ln"):-1]
    gm = checkpoint_segments(gm, [*zoo.block_segments(gm), tail], offload=True)
    kinds = [type(n.target).__name__ for n in gm.graph.nodes if isinstance(n.target, SegmentCall)]
    assert kinds == ["OffloadedSegment", "OffloadedSegment", "RecomputeSegment"]
    assert_same_step(model, gm, args, kwargs, exact=True)


@pytest.mark.slow  # 5 s: make test-real, for make test's margin
def test_a_transformers_model_s_ignored_labels_step_as_eager_s():
    # -100 labels: the loss's mean counts the others; the blocks' inputs wait on the host
    torch.manual_seed(0)
    model, args, kwargs = zoo.hf_gpt2(batch=2, seq=16, layers=2)
    gm = graphopt.trace(model, args, kwargs)
    nodes = list(gm.graph.nodes)
    blocks = [[nodes[i] for i in range(min(at), max(at) + 1)] for at in outer_blocks(nodes).values()]
    gm = checkpoint_segments(gm, blocks, offload=True)
    assert sum(isinstance(n.target, OffloadedSegment) for n in gm.graph.nodes) == 2
    ids = torch.randint(0, 128, (2, 16))  # not the example
    labels = ids.clone()
    labels[:, :5] = -100
    labels[1, 9:] = -100
    assert_same_step(model, gm, (ids,), {"labels": labels}, exact=True)


def test_without_grad_nothing_goes_to_the_host(monkeypatch):
    model, gm, args, kwargs = _gpt(offload=True, layers=2)
    copies = []
    monkeypatch.setattr(offload, "_down", lambda t: copies.append(t) or (t.clone(), t.device, None))
    idx = torch.randint(0, 256, args[0].shape)
    with torch.no_grad():
        torch.manual_seed(1)
        expected = model(idx, targets=kwargs["targets"])
        torch.manual_seed(1)
        got = gm(idx, targets=kwargs["targets"])
    assert torch.equal(expected.logits, got.logits) and not copies
    gm(idx, targets=kwargs["targets"]).loss.backward()
    assert len(copies) == 2  # one block's input each, with grad


def test_a_segment_s_backward_brings_the_next_one_s_inputs_before_its_rerun(monkeypatch):
    """The copies up run beside a backward: segment k's inputs come up before segment k+1 reruns,
    each once, and the last segment's first; the step is still eager's."""
    model, gm, args, kwargs = _gpt(offload=True, layers=3)
    events, brought = [], offload._Kept.bring

    def bring(kept):
        events.append(("up", [t.shape for t, device, _ in kept.stored if device is not None]))
        brought(kept)

    monkeypatch.setattr(offload._Kept, "bring", bring)
    for n in gm.graph.nodes:
        if isinstance(n.target, OffloadedSegment):
            n.target.module.register_forward_pre_hook(
                lambda m, a, k=n.target.index: events.append(("run", k)) if torch.is_grad_enabled() else None)
    idx = torch.randint(0, 256, args[0].shape)
    assert_same_step(model, gm, (idx,), {"targets": torch.randint(0, 256, idx.shape)}, exact=True)
    kinds = [e[0] if e[0] == "up" else e for e in events]
    assert kinds == ["up", "up", ("run", 2), "up", ("run", 1), ("run", 0)]
    assert all(shapes == [torch.Size([8, 64, 64])] for kind, shapes in events if kind == "up")


def test_a_graph_s_calls_are_their_own_and_their_order_is_not_copied():
    _, gm, _, _ = _gpt(offload=True, layers=2)
    segments = [n.target for n in gm.graph.nodes if isinstance(n.target, OffloadedSegment)]
    assert segments[0].order is segments[1].order
    assert copy.deepcopy(segments[0].order).last is None
    _, other, _, _ = _gpt(offload=True, layers=2)
    assert next(n.target for n in other.graph.nodes if isinstance(n.target, OffloadedSegment)).order \
        is not segments[0].order


def test_what_the_segment_does_not_own_stays_where_it_is():
    weight = torch.nn.Parameter(torch.ones(3))
    x = torch.ones(3)
    made = weight * 2
    assert owned(made) and owned(made[1:])
    assert not owned(weight) and not owned(weight[1:]) and not owned(x) and not owned(3.0)


def _gpt_adamw():
    torch.manual_seed(0)
    model, args, kwargs = zoo.gpt(batch=8, seq=64, layers=4)
    return model, args, kwargs, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def _planned(model, args, kwargs, optimizer, budget_bytes: float):
    return graphopt.optimize(model, args, kwargs, budget_gb=budget_bytes / 1e9, optimizer=optimizer, plan_cache=False)


def _least(model, args, kwargs, optimizer, match: str) -> int:
    with pytest.raises(graphopt.BudgetError, match=match) as e:
        _planned(model, args, kwargs, optimizer, 1)
    return e.value.min_budget_bytes


@pytest.mark.slow  # three plans searched: make test-real (make test keeps the refusal that names the step)
def test_below_the_host_step_s_reach_everything_goes_to_the_host():
    model, args, kwargs, adamw = _gpt_adamw()
    least = _least(model, args, kwargs, adamw, "gradients on the host and the recompute segments' inputs too")
    opt = _planned(model, args, kwargs, adamw, least * 1.01)
    stats = opt.graphopt_report.recompute().stats
    assert opt.graphopt_report.host_step.gradients and "offload" not in stats
    assert stats["offloaded_segments"] >= 1 and stats["offloaded_bytes"] > 0 and stats["offload_ms"] > 0
    with pytest.warns(graphopt.BudgetWarning):  # the step as traced fits: nothing moves
        assert "offloaded_segments" not in _planned(model, args, kwargs, adamw, 1e9).graphopt_report.recompute().stats


@pytest.mark.slow  # four plans searched, then two models stepped: make test-real
def test_just_below_the_device_s_reach_the_checkpoints_alone_go_where_they_cost_less_than_the_host_step(monkeypatch):
    """The zoo GPT at 1.6 x the least with everything on the host is below what the device reaches
    (7.3 MB): the checkpoints alone on the host fit, and their copies cost less than the host step."""
    model, args, kwargs, adamw = _gpt_adamw()
    reference = copy.deepcopy(model)
    budget = 1.6 * _least(model, args, kwargs, adamw, "recompute segments' inputs too")
    opt = _planned(model, args, kwargs, adamw, budget)
    stats = opt.graphopt_report.recompute().stats
    assert opt.graphopt_report.host_step is None and "host_step" not in stats
    assert stats["offloaded_segments"] >= 1 and "less than the optimizer's on the host" in stats["offload"]
    assert stats["offload_ms"] < stats["step_ms"]
    eager_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    _steps_bitwise_equal((opt, adamw), (reference, eager_adamw), args[0].shape, steps=2)

    # a host step that costs nothing but its copies, which are fewer bytes than the checkpoints': it wins
    from dataclasses import replace

    from graphopt.analysis import cost

    monkeypatch.setitem(cost.RATES, "cpu", replace(cost.RATES["cpu"], host_step_bytes_per_s=1e18))
    stats = _planned(model, args, kwargs, adamw, budget).graphopt_report.recompute().stats
    assert "offloaded_segments" not in stats and "the segments' inputs alone on the host cost" in stats["host_step"]


@pytest.mark.slow  # three plans searched, then two models stepped: make test-real
def test_where_only_the_checkpoints_alone_fit_their_plan_is_made_again_and_steps_as_eager(monkeypatch):
    from dataclasses import replace

    from graphopt.analysis import cost
    from graphopt.passes.recompute.recompute_pass import Recompute

    model, args, kwargs, adamw = _gpt_adamw()
    reference = copy.deepcopy(model)
    budget = 1.6 * _least(model, args, kwargs, adamw, "recompute segments' inputs too")
    monkeypatch.setitem(cost.RATES, "cpu", replace(cost.RATES["cpu"], host_step_bytes_per_s=1e18))
    on_device = Recompute._plan_on_device

    def no_host_step_fits(self, gm, ctx):  # as where the optimizer's state frees less than the checkpoints
        if self.host is not None:
            raise graphopt.BudgetError("the host step does not fit", min_budget_bytes=10 * int(budget))
        return on_device(self, gm, ctx)

    monkeypatch.setattr(Recompute, "_plan_on_device", no_host_step_fits)
    opt = _planned(model, args, kwargs, adamw, budget)
    stats = opt.graphopt_report.recompute().stats
    assert opt.graphopt_report.host_step is None and stats["offloaded_segments"] >= 1
    eager_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    _steps_bitwise_equal((opt, adamw), (reference, eager_adamw), args[0].shape, steps=2)


def test_without_an_optimizer_the_checkpoints_go_to_the_host_below_the_device_s_reach():
    """Where they lower the least (with 2 blocks they would not: a backward holds the next block's
    inputs as well as its own, and the refusal names the device's least, the lesser)."""
    torch.manual_seed(0)
    model, args, kwargs = zoo.gpt(batch=8, seq=64, layers=4)
    with pytest.raises(graphopt.BudgetError, match="with the recompute segments' inputs on the host needs") as e:
        graphopt.optimize(model, args, kwargs, budget_gb=1e-9, plan_cache=False)
    opt = graphopt.optimize(model, args, kwargs, budget_gb=e.value.min_budget_bytes * 1.01 / 1e9, plan_cache=False)
    stats = opt.graphopt_report.recompute().stats
    assert stats["offloaded_segments"] >= 4 and stats["offload"].startswith("on the device the least plan needs")
    idx = torch.randint(0, 256, args[0].shape)  # not the example
    assert_same_step(model, opt, (idx,), {"targets": torch.randint(0, 256, idx.shape)}, exact=True)


@pytest.mark.slow  # two plans searched to the least: make test-real
def test_three_adamw_steps_with_everything_on_the_host_equal_eager_s_bit_for_bit():
    torch.manual_seed(0)
    model, args, kwargs = zoo.gpt(batch=8, seq=64, layers=4)
    reference = copy.deepcopy(model)
    adamw, eager_adamw = (torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (model, reference))
    opt = _at_the_least(model, args, kwargs, adamw)
    _steps_bitwise_equal((opt, adamw), (reference, eager_adamw), args[0].shape, steps=3)


@pytest.mark.slow  # a least searched, then two models stepped: make test-real
def test_with_precision_bf16_everything_on_the_host_steps_as_bf16_on_the_device():
    torch.manual_seed(0)
    model, args, kwargs = zoo.gpt(batch=8, seq=64, layers=4)
    reference = copy.deepcopy(model)
    adamw, device_adamw = (torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (model, reference))
    hosted = _at_the_least(model, args, kwargs, adamw, precision="bf16")
    on_device = graphopt.optimize(reference, args, kwargs, precision="bf16")
    _steps_bitwise_equal((hosted, adamw), (on_device, device_adamw), args[0].shape, steps=2)


@pytest.mark.slow  # a least searched, then microbatch counts planned: make test-real
def test_train_step_s_microbatches_compose_with_everything_on_the_host():
    torch.manual_seed(0)
    model, args, kwargs = zoo.llama(batch=8, seq=64)  # no dropout: microbatches draw nothing
    reference = copy.deepcopy(model)
    adamw, eager_adamw = (torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (model, reference))
    with pytest.raises(graphopt.BudgetError) as refused:
        graphopt.optimize(model, args, kwargs, budget_gb=1e-9, optimizer=adamw, plan_cache=False)
    # below the whole batch's least: microbatches, with the checkpoints on the host
    step = graphopt.train_step(model, args, kwargs, budget_gb=refused.value.min_budget_bytes * 0.6 / 1e9,
                               optimizer=adamw)
    stats = step.graph.graphopt_report.recompute().stats
    assert step.microbatches > 1 and stats["offloaded_segments"] >= 1
    for _ in range(2):
        idx, targets = torch.randint(0, 256, args[0].shape), torch.randint(0, 256, args[0].shape)
        loss = step(idx, targets=targets)
        reference(idx, targets=targets).backward()
        for optimizer in (adamw, eager_adamw):
            optimizer.step()
            optimizer.zero_grad()
    # the microbatches' gradients add up in another order than the whole batch's
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=name)
    assert loss.shape == ()


def _at_the_least(model, args, kwargs, optimizer, **options):
    """The graph planned 1% above the least budget any plan reaches: the checkpoints on the host."""
    with pytest.raises(graphopt.BudgetError) as refused:
        graphopt.optimize(model, args, kwargs, budget_gb=1e-9, optimizer=optimizer, plan_cache=False, **options)
    opt = graphopt.optimize(model, args, kwargs, budget_gb=refused.value.min_budget_bytes * 1.01 / 1e9,
                            optimizer=optimizer, plan_cache=False, **options)
    assert opt.graphopt_report.recompute().stats["offloaded_segments"] >= 1
    return opt


def _steps_bitwise_equal(planned, reference, shape, steps: int) -> None:
    """(module, optimizer) pairs stepped on the same batches, other than the example, with the same
    dropout masks: their losses and then their parameters bit for bit."""
    for step in range(steps):
        idx, targets = torch.randint(0, 256, shape), torch.randint(0, 256, shape)
        losses = []
        for module, optimizer in (planned, reference):
            torch.manual_seed(step)
            loss = module(idx, targets=targets).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss)
        assert torch.equal(*losses), step
    for (name, p), q in zip(planned[0].named_parameters(), reference[0].parameters()):
        assert torch.equal(p, q), name


def test_the_step_waits_for_every_copy_on_cpu_and_for_what_compute_does_not_hide_on_cuda(monkeypatch):
    from dataclasses import replace

    from graphopt.analysis import cost

    _, gm, _, _ = _gpt(offload=True)
    moved = offloaded_bytes(gm)
    on_cpu = offload_time(gm, "cpu")
    assert on_cpu.waited_s == on_cpu.copies_s == pytest.approx(2 * moved / cost.rates("cpu").host_bytes_per_s)
    one = moved / 4  # each of the four blocks' inputs

    def at(link: float):
        monkeypatch.setitem(cost.RATES, "cuda", replace(cost.RATES["cuda"], host_bytes_per_s=link))
        return offload_time(gm, "cuda")

    fast, slow = at(2.5e10), at(2.5e7)
    assert fast.copies_s == pytest.approx(2 * moved / 2.5e10)
    # the first segment back waits for its copy whole; the rest hide behind the compute at this rate
    assert fast.waited_s == pytest.approx(one / 2.5e10)
    # a link a thousand times slower: every copy outlasts the compute beside it
    assert one / 2.5e7 < slow.waited_s < slow.copies_s and slow.waited_s > 0.5 * slow.copies_s


def test_gradients_go_down_beside_the_backward_that_follows_their_first_reader(monkeypatch):
    from dataclasses import replace

    from graphopt.analysis import cost
    from graphopt.analysis.host_step import trainable_bytes

    model, gm, _, _ = _gpt(offload=True)
    total = trainable_bytes(model.parameters())
    assert offload_time(gm, "cuda").gradients_waited_s == 0.0  # without gradients none go down
    assert offload_time(gm, "cpu", gradients=True).gradients_waited_s == \
        pytest.approx(total / cost.rates("cpu").host_bytes_per_s)  # each copied where backward makes it

    def waited(link: float) -> float:
        monkeypatch.setitem(cost.RATES, "cuda", replace(cost.RATES["cuda"], host_bytes_per_s=link))
        return offload_time(gm, "cuda", gradients=True).gradients_waited_s

    # a fast link: only the gradient that the backward's last node completes is still going down when it
    # ends: the token embedding's, read first in the forward (the output head shares it)
    first = model.tok.weight.nbytes
    assert waited(2.5e10) == pytest.approx(first / 2.5e10)
    # a link a thousand times slower: the copies outlast the backward beside them, most of them waited
    assert first / 2.5e7 < waited(2.5e7) < total / 2.5e7


def test_every_gradient_goes_down_once_batch_norms_run_once_in_segments_included():
    from graphopt.analysis.cost import rates
    from graphopt.analysis.host_step import trainable_bytes

    torch.manual_seed(0)
    model, args, kwargs = zoo.convnet()
    gm = graphopt.trace(model, args, kwargs)
    nodes = list(gm.graph.nodes)
    blocks = [[nodes[i] for i in range(min(at), max(at) + 1)] for at in outer_blocks(nodes).values()]
    gm = checkpoint_segments(gm, blocks, offload=True)
    assert sum(isinstance(n.target, SegmentCall) for n in gm.graph.nodes) == 5  # the stem's conv, batch norm and ReLU, and 2 blocks
    # on CPU each gradient is waited for whole: their sum is every trainable parameter, the batch norms'
    # held by their run-once calls (not the segment module's attributes) too
    assert offload_time(gm, "cpu", gradients=True).gradients_waited_s == \
        pytest.approx(trainable_bytes(model.parameters()) / rates("cpu").host_bytes_per_s)


def test_a_second_backward_through_offloaded_checkpoints_is_refused_in_words():
    _, gm, args, kwargs = _gpt(offload=True, layers=2)
    loss = gm(*args, **kwargs).loss
    loss.backward(retain_graph=True)
    with pytest.raises(graphopt.UsageError, match="come back for one backward only"):
        loss.backward()


class _ReturnsItsScale(torch.nn.Module):
    """A block one of whose outputs is its parameter itself: `.to` of the parameter's own dtype returns it
    (transformers' Mamba mixer does this with its D)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.rand(8))

    def forward(self, x):
        return torch.tanh(self.lin(x)), self.scale.to(torch.float32)


class _TwoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_ReturnsItsScale(), _ReturnsItsScale()])

    def forward(self, x):
        for block in self.blocks:
            y, scale = block(x)
            x = y * scale + x
        return x.square().mean()


def test_a_segment_returning_a_parameter_itself_leaves_it_a_leaf_and_steps_as_eager():
    torch.manual_seed(0)
    model = _TwoBlocks()
    x = torch.randn(4, 8)
    gm = graphopt.trace(model, (x * 2,))
    nodes = list(gm.graph.nodes)
    blocks = [[nodes[i] for i in range(min(at), max(at) + 1)] for at in outer_blocks(nodes).values()]
    gm = checkpoint_segments(gm, blocks, offload=True)
    assert sum(isinstance(n.target, OffloadedSegment) for n in gm.graph.nodes) == 2
    gm(x).backward()
    assert all(p.is_leaf and p.grad_fn is None for p in model.parameters())
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model(x).backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[name]), name


def test_an_offloaded_batch_norm_of_the_input_gets_its_gradients_as_eager():
    # the segment's one input needs no gradient and its parameters are the batch norm's, which its
    # run-once call holds outside the segment module: without them the outputs need none either
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    gm = graphopt.trace(model, (torch.randn(16, 8),))
    nodes = list(gm.graph.nodes)
    blocks = [[nodes[i] for i in range(min(at), max(at) + 1)] for at in outer_blocks(nodes).values()]
    gm = checkpoint_segments(gm, blocks, offload=True)
    assert sum(isinstance(n.target, OffloadedSegment) for n in gm.graph.nodes) == 2
    assert_same_step(model, gm, (torch.randn(16, 8),), {}, exact=True)  # not the example
