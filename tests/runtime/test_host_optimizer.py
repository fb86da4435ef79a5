"""graphopt.runtime.host_optimizer: the optimizer's step on the host, installed on the user's own
optimizer, equals the step on the device (bitwise on CPU, where the host runs the same kernels)."""
import copy

import pytest
import torch

import graphopt
from graphopt.analysis.memory import backward_roots, measure_peak
from graphopt.runtime.host_optimizer import fastest_on_host, host_gradients, install_host_optimizer, installed
from graphopt.testing import zoo

BELOW_ON_DEVICE = 3.0e-3  # GB: the MLP below steps with AdamW's state in 4.9 MB on the device, 2.3 MB off it


def _mlp():
    torch.manual_seed(0)
    return zoo.mlp(batch=64, width=256, depth=4)


def _step(model, optimizer, x):
    torch.manual_seed(1)  # the same dropout masks on both sides
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def test_adamw_steps_on_the_host_equal_the_device_s_bitwise_with_a_scheduler():
    model, args, _ = _mlp()
    ref = copy.deepcopy(model)
    ours, theirs = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False) for m in (model, ref))
    opt = graphopt.optimize(model, args, budget_gb=BELOW_ON_DEVICE, optimizer=ours, plan_cache=False)
    assert opt.graphopt_report.host_step is not None
    schedules = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (ours, theirs)]
    for _ in range(4):
        x = torch.randn_like(args[0])  # batches the plan was not made on
        assert torch.equal(_step(opt, ours, x), _step(ref, theirs, x))
        for s in schedules:
            s.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    # a checkpoint holds the state where it lives, and loads back into it
    saved, expected = ours.state_dict(), theirs.state_dict()
    assert saved["state"].keys() == expected["state"].keys()
    assert all(torch.equal(saved["state"][k]["exp_avg_sq"], expected["state"][k]["exp_avg_sq"]) for k in saved["state"])
    assert not ours.state  # the user's optimizer holds none of it on the device
    ours.load_state_dict(saved)
    x = torch.randn_like(args[0])
    assert torch.equal(_step(opt, ours, x), _step(ref, theirs, x))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_left_unset_the_host_runs_the_fused_kernel_within_rounding_of_the_device_s_loop():
    model, args, _ = _mlp()
    ref = copy.deepcopy(model)
    ours, theirs = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    opt = graphopt.optimize(model, args, budget_gb=BELOW_ON_DEVICE, optimizer=ours, plan_cache=False)
    assert all(g["fused"] for g in installed(ours).host.param_groups)
    for _ in range(3):
        x = torch.randn_like(args[0])
        torch.testing.assert_close(_step(opt, ours, x), _step(ref, theirs, x), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):  # Adam divides by sqrt(v): a few ulps grow
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    ours.load_state_dict(ours.state_dict())  # a checkpoint loaded keeps the host's kernel
    assert all(g["fused"] for g in installed(ours).host.param_groups)


def test_a_chosen_implementation_is_the_host_s_too():
    params = [torch.nn.Parameter(torch.ones(3))]
    for chosen in ({"foreach": False}, {"foreach": True}, {"fused": False}):
        optimizer = torch.optim.AdamW(params, **chosen)
        assert fastest_on_host(optimizer) is optimizer
    assert fastest_on_host(torch.optim.AdamW(params)).param_groups[0]["fused"] is True


def test_a_resumed_optimizer_s_state_moves_to_the_host():
    model, args, _ = _mlp()
    ours = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    _step(model, ours, args[0])  # one step on the device makes its state
    ref = copy.deepcopy(model)
    theirs = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=False)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    install_host_optimizer(ours)
    assert not ours.state
    for _ in range(2):
        x = torch.randn_like(args[0])
        assert torch.equal(_step(model, ours, x), _step(ref, theirs, x))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_the_device_peak_of_a_step_with_the_host_step_is_the_prediction():
    model, args, _ = _mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    opt = graphopt.optimize(model, args, budget_gb=BELOW_ON_DEVICE, optimizer=optimizer, plan_cache=False)
    fit = opt.graphopt_report.recompute().budget
    assert fit.predicted_peak_bytes <= fit.planned_for_bytes < fit.peak_before_bytes

    def step():
        roots = backward_roots(opt(*args))
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        optimizer.step()

    for _ in range(2):  # the first step makes the host state, the second runs with it
        assert measure_peak(step, opt, *args) == fit.predicted_peak_bytes
        optimizer.zero_grad()


def test_a_closure_is_refused_and_a_named_optimizer_needs_the_instance():
    model, args, _ = _mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    install_host_optimizer(optimizer)
    with pytest.raises(graphopt.UsageError, match="closure"):
        optimizer.step(lambda: 0.0)
    model, args, _ = _mlp()
    with pytest.raises(graphopt.UsageError, match="optimizer=torch.optim.AdamW"):
        graphopt.optimize(model, args, budget_gb=BELOW_ON_DEVICE, optimizer="adamw", plan_cache=False)


def test_train_step_plans_and_steps_with_the_optimizer_on_the_host():
    torch.manual_seed(0)
    model, args, kwargs = zoo.gpt(batch=4, seq=32, layers=2)
    ref = copy.deepcopy(model)
    ours, theirs = (torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False) for m in (model, ref))
    with pytest.raises(graphopt.BudgetError) as least:  # the least with the state and step on the host
        graphopt.optimize(copy.deepcopy(model), args, kwargs, budget_gb=1e-9, plan_cache=False,
                          optimizer=torch.optim.AdamW(model.parameters()))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = (least.value.min_budget_bytes + params) / 1e9  # AdamW's state is twice the parameters: not on the device
    step = graphopt.train_step(model, args, kwargs, budget_gb=budget, optimizer=ours)
    assert step.report.host_step is not None and step.predicted_peak_bytes <= budget * 1e9
    for _ in range(3):
        idx, targets = torch.randint(0, 256, args[0].shape), torch.randint(0, 256, args[0].shape)
        torch.manual_seed(1)
        loss = step(idx, targets=targets)
        ours.step()
        ours.zero_grad()
        torch.manual_seed(1)
        want = ref(idx, targets=targets).loss
        want.backward()
        theirs.step()
        theirs.zero_grad()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_gradients_on_the_host_step_as_on_the_device_and_refuse_to_be_read_there():
    torch.manual_seed(0)
    model, args, _ = zoo.mlp(batch=4, width=512, depth=4)  # parameters over activations: gradients matter
    ref = copy.deepcopy(model)
    ours, theirs = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False) for m in (model, ref))
    opt = graphopt.optimize(model, args, budget_gb=6.5e-3, optimizer=ours, plan_cache=False)
    host = opt.graphopt_report.host_step
    assert host is not None and host.gradients and "state, step and gradients" in str(opt.graphopt_report)

    def step(m, o, x, microbatches):
        for k in range(microbatches):  # accumulated by hand: the host adds them up
            torch.manual_seed(1 + k)
            loss = m(x).square().mean()
            loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()

    for microbatches in (1, 2, 1):
        x = torch.randn_like(args[0])
        assert torch.equal(step(opt, ours, x, microbatches), step(ref, theirs, x, microbatches))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    torch.manual_seed(3)
    opt(args[0]).square().mean().backward()
    with pytest.raises(graphopt.UsageError, match="gradient is on the host"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # never a silent clip of nothing
    torch.manual_seed(3)
    ref(args[0]).square().mean().backward()
    on_host = host_gradients(ours)
    assert all(torch.equal(on_host[p], q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    ours.zero_grad()

    def measured_step():
        roots = backward_roots(opt(*args))
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        ours.step()

    fit = opt.graphopt_report.recompute().budget
    assert measure_peak(measured_step, opt, *args) == fit.predicted_peak_bytes <= fit.planned_for_bytes
    ours.zero_grad()
    measured = graphopt.measure_step(opt, args, loss_fn=lambda out, x: out.square().mean(), optimizer=ours)
    assert measured.peak_bytes <= fit.planned_for_bytes  # the device's step: the host's step and state not in it
    assert all(g is None for g in host_gradients(ours).values())  # and the host holds what it held before


def test_parameters_written_on_the_device_reach_the_host_copy_before_its_step():
    model, args, _ = _mlp()
    ref = copy.deepcopy(model)
    ours, theirs = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=False) for m in (model, ref))
    install_host_optimizer(ours)
    _step(model, ours, args[0]), _step(ref, theirs, args[0])
    loaded = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}  # a checkpoint loaded between steps
    model.load_state_dict(loaded)
    ref.load_state_dict(loaded)
    x = torch.randn_like(args[0])
    assert torch.equal(_step(model, ours, x), _step(ref, theirs, x))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.slow  # a transformers model, planned twice: make test-real
def test_transformers_gpt2_steps_on_the_host_as_on_the_device_with_padded_labels():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 512, (4, 32))
    ours, theirs = (torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False) for m in (model, ref))
    with pytest.raises(graphopt.BudgetError) as least:
        graphopt.optimize(copy.deepcopy(model), (ids,), {"labels": ids.clone()}, budget_gb=1e-9, plan_cache=False,
                          optimizer=torch.optim.AdamW(model.parameters()))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = (least.value.min_budget_bytes + params) / 1e9  # AdamW's state does not fit beside the step
    opt = graphopt.optimize(model, (ids,), {"labels": ids.clone()}, budget_gb=budget, optimizer=ours, plan_cache=False)
    assert opt.graphopt_report.host_step is not None
    for _ in range(3):  # other batches: labels apart from the inputs, padded with -100
        x, y = torch.randint(0, 512, (4, 32)), torch.randint(0, 512, (4, 32))
        y[:, 20:] = -100
        for m, o in ((opt, ours), (ref, theirs)):
            m(x, labels=y).loss.backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
