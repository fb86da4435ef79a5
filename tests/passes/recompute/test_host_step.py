"""The recompute pass's step 9: below what keep-or-recompute reaches with the optimizer on the
device, the optimizer's state and step go to the host (analysis/host_step.py); above it, they stay."""
import pytest
import torch

import graphopt
from graphopt.testing import zoo

MB = 1e-3  # budget_gb of one MB


def _mlp():
    torch.manual_seed(0)
    return zoo.mlp(batch=64, width=256, depth=4)  # AdamW's step: 4.9 MB on the device, 2.3 MB without its state


@pytest.mark.filterwarnings("ignore::graphopt.BudgetWarning")  # 6 MB holds the step as traced
@pytest.mark.parametrize("budget_mb, on_host", [(6.0, False), (3.0, True)])
def test_the_host_step_is_chosen_only_below_what_the_device_reaches(budget_mb, on_host):
    model, args, _ = _mlp()
    opt = graphopt.optimize(model, args, budget_gb=budget_mb * MB, optimizer=torch.optim.AdamW(model.parameters()),
                            plan_cache=False)
    report = opt.graphopt_report
    assert (report.host_step is not None) == on_host
    fit = report.recompute().budget
    assert fit.predicted_peak_bytes <= fit.planned_for_bytes
    if on_host:
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        assert report.host_step.param_bytes == params and report.host_step.state_bytes >= 2 * params
        assert fit.peak_before_bytes - fit.predicted_peak_bytes >= report.host_step.state_bytes  # the state is off
        assert "optimizer on the host" in str(report) and "host_step=on the device the least plan needs" in str(report)
    else:
        assert "on the host" not in str(report)


def test_below_the_host_step_s_least_the_refusal_says_it_was_tried():
    model, args, _ = _mlp()
    # the least of the ways tried: here the checkpoints on the host as well need more than without them
    # (a segment's backward holds the next one's inputs too)
    with pytest.raises(graphopt.BudgetError, match="with the optimizer's state, step and gradients on the host needs"):
        graphopt.optimize(model, args, budget_gb=1.0 * MB, optimizer=torch.optim.AdamW(model.parameters()),
                          plan_cache=False)


def test_without_an_optimizer_the_refusal_names_the_host_as_a_way_down_not_as_tried():
    model, args, _ = _mlp()
    with pytest.raises(graphopt.BudgetError, match=r"give optimizer= \(the one you step: the plan may then keep its "
                                                   "state, step and gradients on the host") as refused:
        graphopt.optimize(model, args, budget_gb=1.0 * MB, plan_cache=False)
    assert "one training step needs at least" in str(refused.value)  # not "with ... on the host needs"


def test_plan_answers_with_the_host_step_on_the_meta_device():
    with torch.device("meta"):
        model = zoo.MLP(256, 4)
    x = torch.randn(64, 256, device="meta")
    loss = lambda out, x: out.square().mean()  # noqa: E731
    answer = graphopt.plan(model, (x,), budget_gb=3.0 * MB, device="cpu", optimizer="adamw", loss_fn=loss)
    assert answer.fits and answer.host_step is not None
    assert "the optimizer's state and step on the host" in str(answer)
    assert answer.predicted_peak_bytes <= answer.budget_bytes
    on_device = graphopt.plan(model, (x,), budget_gb=6.0 * MB, device="cpu", optimizer="adamw", loss_fn=loss)
    assert on_device.fits and on_device.host_step is None


def test_train_step_takes_microbatches_on_the_device_before_the_host_step():
    # 13 MB: the whole batch fits with AdamW's step on the host (12.7 MB) and 2 microbatches with it on the
    # device (12.7 MB); the microbatches cost less a step
    torch.manual_seed(0)
    model, args, kwargs = zoo.gpt(batch=16, seq=64, layers=2, dim=128)
    answer = graphopt.plan(model, args, kwargs, budget_gb=13 * MB, device="cpu", optimizer="adamw")
    assert answer.fits and answer.microbatches == 2 and answer.host_step is None


def test_over_microbatches_each_further_one_s_gradients_are_copied_down_and_added_on_the_host():
    from graphopt.analysis.cost import rates
    from graphopt.analysis.host_step import host_step
    from graphopt.analysis.optimizer_memory import optimizer_memory

    model = zoo.MLP(256, 4)
    params = list(model.parameters())
    memory = optimizer_memory(torch.optim.AdamW(params), params)
    nbytes, r = sum(p.nbytes for p in params), rates("cpu")
    moved, kept = host_step(params, memory, "cpu", gradients=True), host_step(params, memory, "cpu")
    assert moved.seconds_over(1) == moved.seconds and kept.seconds_over(3) == kept.seconds  # one copy down at the step
    assert moved.seconds_over(3) - moved.seconds == \
        pytest.approx(2 * (nbytes / r.host_bytes_per_s + nbytes / r.host_add_bytes_per_s))
