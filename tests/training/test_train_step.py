"""graphopt.train_step: one training step within a budget, in the fewest equal microbatches whose
planned step fits; gradients those of the full batch, measured peak within the budget, and a
clear graphopt error for every misuse.

Gradients are compared with eager's full-batch step with dropout off (a microbatch draws other
masks than the full batch): max |train_step - eager| / max |eager| per parameter, 1e-5 in float32;
on the corpus by verify.compare, where a gradient that is rounding noise in float32 eager itself
is held to a float64 step instead. `make test` runs one corpus model (GPT-2); `make test-real`
(`-m realmodels --corpus=all`) every one, at a budget a quarter of the way from parameters +
gradients to eager's measured peak, or where that is refused, 1% above the least budget the
refusal names (BatchNorm models: memory and the warning only), on the example and on a second
batch drawn apart from it (against eager on the same microbatches).
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

import graphopt
from graphopt.analysis.memory import GB, measure_peak
from graphopt.runtime.microbatch import split_batch
from graphopt.runtime.step import clear_grads, run_step, step_loss, step_peak
from graphopt.testing import zoo
from graphopt.verification.verify import compare, float64_copy

EXACT = 1e-5
QUICK_CORPUS = ("hf_gpt2",)  # fits in microbatches
CORPUS_REPEAT = 4  # the corpus batch of 2 rows, 8 rows here: room for microbatches
CORPUS_F = 0.25
# corpus models that draw random numbers as their function, not as dropout: a VAE samples its latents
SAMPLES = {"diffusers_vae"}


def pytest_generate_tests(metafunc):
    if "train_step_model" in metafunc.fixturenames:
        from corpus import CORPUS

        all_ = metafunc.config.getoption("--corpus") == "all"
        metafunc.parametrize("train_step_model", list(CORPUS) if all_ else list(QUICK_CORPUS))


# -- helpers ----------------------------------------------------------------------------------

_DROP_ATTRS = ("dropout", "drop_prob", "dropout_prob", "attention_dropout", "attn_dropout_p")


def no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Dropout and drop-path off, training mode kept (BatchNorm still uses batch statistics)."""
    for m in model.modules():
        names = _DROP_ATTRS + (("p",) if "Drop" in type(m).__name__ or "Depth" in type(m).__name__ else ())
        for name in names:
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    return model


def eager_step(model, args, kwargs, loss_fn=None, seed=0, microbatches=1, weights=None):
    """(loss, {parameter: grad}) of eager's full-batch step, or of its microbatches one after
    another, each loss scaled by its weight (default 1/k, train_step's reduction="mean"); grads None
    before and after."""
    clear_grads(model)
    torch.manual_seed(seed)
    losses = []
    weights = weights or [1 / microbatches] * microbatches
    for (a, k), weight in zip(split_batch(args, kwargs, microbatches), weights):
        loss = step_loss(model, a, k, loss_fn) * weight
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    clear_grads(model)
    return sum(losses), grads


def train_step_grads(step, model, args, kwargs):
    clear_grads(model)
    loss = step(*args, **kwargs)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    clear_grads(model)
    return loss, grads


def rel_error(got: dict, want: dict) -> float:
    assert got.keys() == want.keys() and want
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30)) for n in want)


def measured_peak(step, model, args, kwargs) -> int:
    """Peak bytes of the train step's call, parameters, buffers and inputs resident, grads None before."""
    clear_grads(model)
    try:
        return measure_peak(lambda: step(*args, **kwargs), model, *args, *kwargs.values())
    finally:
        clear_grads(model)


def least_full_batch(model, args, kwargs) -> float:
    """The least budget (bytes) graphopt.optimize names for the full batch."""
    with pytest.raises(graphopt.BudgetError) as e:
        graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=1e-9)
    return e.value.min_budget_gb * GB


def small_gpt(batch=8, targets=True):
    torch.manual_seed(0)
    model, args, kwargs = zoo.gpt(batch=batch, seq=32, layers=2, dim=32, heads=2, vocab=128, targets=targets)
    return no_dropout(model), args, kwargs


def next_token_loss(out, idx):
    """An LM loss outside the model, in float64: its memory is none of the graph's."""
    logits = out.logits.double()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).float()


def mse(out, x):
    return out.square().mean()


# -- gradients ----------------------------------------------------------------------------------

@pytest.mark.parametrize("microbatches", [1, 2, 8])
def test_gradients_equal_the_full_batch(microbatches):
    model, args, kwargs = small_gpt()
    want_loss, want = eager_step(model, args, kwargs)
    step = graphopt.train_step(model, args, kwargs, microbatches=microbatches)
    assert step.microbatches == microbatches
    loss, got = train_step_grads(step, model, args, kwargs)
    assert rel_error(got, want) <= EXACT
    assert not loss.requires_grad and torch.allclose(loss, want_loss, rtol=EXACT)


def test_gradients_add_to_those_already_there():
    model, args, kwargs = small_gpt()
    _, want = eager_step(model, args, kwargs)
    step = graphopt.train_step(model, args, kwargs, microbatches=4)
    clear_grads(model)
    step(*args, **kwargs)
    step(*args, **kwargs)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    clear_grads(model)
    assert rel_error(got, {n: 2 * g for n, g in want.items()}) <= EXACT


def test_a_loss_outside_the_model():
    torch.manual_seed(0)
    model, args, _ = zoo.mlp(batch=16)
    no_dropout(model)
    want_loss, want = eager_step(model, args, {}, mse)
    step = graphopt.train_step(model, args, loss_fn=mse, microbatches=4)
    loss, got = train_step_grads(step, model, args, {})
    assert rel_error(got, want) <= EXACT and torch.allclose(loss, want_loss, rtol=EXACT)


def test_a_sum_reduced_loss_takes_reduction_sum():
    torch.manual_seed(0)
    model, args, _ = zoo.mlp(batch=16)
    no_dropout(model)

    def summed(out, x):
        return out.square().sum()

    want_loss, want = eager_step(model, args, {}, summed)
    step = graphopt.train_step(model, args, loss_fn=summed, microbatches=4, reduction="sum")
    loss, got = train_step_grads(step, model, args, {})
    assert rel_error(got, want) <= EXACT and torch.allclose(loss, want_loss, rtol=EXACT)
    # the mean rule on a sum loss would scale every gradient by 1/4
    meant = graphopt.train_step(model, args, loss_fn=summed, microbatches=4)
    _, scaled = train_step_grads(meant, model, args, {})
    assert rel_error(scaled, {n: g / 4 for n, g in want.items()}) <= EXACT


# -- budgets ------------------------------------------------------------------------------------

def test_without_a_budget_one_microbatch():
    model, args, kwargs = small_gpt()
    step = graphopt.train_step(model, args, kwargs)
    assert step.microbatches == 1 and step.report is step.graph.graphopt_report


def test_a_budget_the_full_batch_fits_keeps_one_microbatch():
    model, args, kwargs = small_gpt()
    budget = step_peak(model, model, args, kwargs)
    step = graphopt.train_step(model, args, kwargs, budget_gb=budget / GB)
    assert step.microbatches == 1
    assert measured_peak(step, model, args, kwargs) <= budget


@pytest.fixture(scope="module")
def planned():
    """The small GPT at 85% of the least budget its full batch has: (model, args, kwargs, budget, step)."""
    model, args, kwargs = small_gpt()
    budget = 0.85 * least_full_batch(model, args, kwargs)
    return model, args, kwargs, budget, graphopt.train_step(model, args, kwargs, budget_gb=budget / GB)


def test_a_budget_below_the_full_batch_splits_it_and_holds(planned):
    model, args, kwargs, budget, step = planned
    _, want = eager_step(model, args, kwargs)
    assert step.microbatches > 1 and 8 % step.microbatches == 0
    assert any("microbatches" in line for line in step.notes)
    assert f"train_step: {step.microbatches} equal microbatches" in str(step.report)
    assert measured_peak(step, model, args, kwargs) == step.predicted_peak_bytes <= budget
    _, got = train_step_grads(step, model, args, kwargs)
    assert rel_error(got, want) <= EXACT


def test_the_accumulated_gradients_are_in_the_plan(planned):
    # From the second microbatch on every gradient is resident: the same microbatches through a
    # plan of one microbatch's step alone, as optimize() makes it, overshoot the budget.
    model, args, kwargs, budget, step = planned
    k = step.microbatches
    parts = split_batch(args, kwargs, k)
    alone = graphopt.optimize(model, parts[0][0], example_kwargs=parts[0][1], budget_gb=budget / GB)

    def naive(*a, **kw):
        for mb_args, mb_kwargs in split_batch(a, kw, k):
            (alone(*mb_args, **mb_kwargs).loss / k).backward()

    assert measured_peak(naive, model, args, kwargs) > budget >= measured_peak(step, model, args, kwargs)


@pytest.mark.slow
def test_a_loss_outside_the_graph_is_in_the_budget():
    model, args, _ = small_gpt(batch=4, targets=False)
    _, want = eager_step(model, args, {}, next_token_loss)
    budget = least_full_batch(model, args, {})  # the graph alone fits; with its float64 loss it does not
    step = graphopt.train_step(model, args, loss_fn=next_token_loss, budget_gb=budget / GB)
    assert measured_peak(step, model, args, {}) <= budget
    _, got = train_step_grads(step, model, args, {})
    assert rel_error(got, want) <= EXACT


def test_no_plan_names_a_budget_that_works():
    torch.manual_seed(0)
    model, args, _ = zoo.mlp(batch=4, width=32, depth=2)
    no_dropout(model)

    def heavy(out, x):  # a float64 copy of the output, outside the graph
        return out.double().square().mean().float()

    with pytest.raises(graphopt.BudgetError, match="any number of equal microbatches") as e:
        graphopt.train_step(model, args, loss_fn=heavy, budget_gb=1e-6)
    least = e.value.min_budget_gb * GB
    step = graphopt.train_step(model, args, loss_fn=heavy, budget_gb=least / GB)
    assert measured_peak(step, model, args, {}) <= least


@pytest.mark.slow
def test_the_budget_covers_the_optimizer_too():
    model, args, kwargs = small_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    with pytest.raises(graphopt.BudgetError) as e:
        graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=1e-9, optimizer=optimizer)
    budget = 0.9 * e.value.min_budget_gb * GB
    step = graphopt.train_step(model, args, kwargs, budget_gb=budget / GB, optimizer=optimizer)
    assert step.microbatches > 1
    clear_grads(model)
    step(*args, **kwargs)
    optimizer.step()  # its state exists from now on, as in every step after the first
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    clear_grads(model)
    peak = measure_peak(lambda: (step(*args, **kwargs), optimizer.step()), model, *args, *kwargs.values(), state)
    clear_grads(model)
    assert peak <= budget


def test_a_microbatch_the_model_cannot_run_is_skipped():
    # BatchNorm1d in training needs two rows: microbatches of one row do not trace
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    x = torch.randn(4, 8)
    with pytest.raises(graphopt.BudgetError, match=r"tried 1, 2; 4 microbatches do not trace"):
        graphopt.train_step(model, (x,), loss_fn=mse, budget_gb=1e-6)
    with pytest.raises(graphopt.TraceError):
        graphopt.train_step(model, (x,), loss_fn=mse, microbatches=4)


# 16 s: make test-real; the split to a budget stays in make test (test_a_budget_below_the_full_batch_splits_it_and_holds)
@pytest.mark.slow
def test_forced_microbatches_over_budget_is_a_budget_error():
    model, args, kwargs = small_gpt()
    with pytest.raises(graphopt.BudgetError, match="in 2 microbatches"):
        graphopt.train_step(model, args, kwargs, budget_gb=1e-6, microbatches=2)


# -- warnings and errors ------------------------------------------------------------------------

def test_batchnorm_in_microbatches_warns():
    torch.manual_seed(0)
    model, args, _ = zoo.convnet(batch=4, size=8)
    with pytest.warns(UserWarning, match=r"BatchNorm in training \(.*BatchNorm2d\) and 1 more\) normalizes"):
        step = graphopt.train_step(model, args, loss_fn=mse, microbatches=2)
    assert any("BatchNorm" in line for line in step.notes)
    assert "and 1 more) normalizes" in str(step.report) and "and 1 more) normalizes" in step.report.to_markdown()


@pytest.mark.parametrize("microbatches, training", [(1, True), (2, False)])
def test_batchnorm_warns_only_where_statistics_differ(microbatches, training, recwarn):
    torch.manual_seed(0)
    model, args, _ = zoo.convnet(batch=4, size=8)
    model.train(training)
    step = graphopt.train_step(model, args, loss_fn=mse, microbatches=microbatches)
    assert not [w for w in recwarn if "BatchNorm" in str(w.message)] and not step.notes


def test_no_loss_and_no_loss_fn_is_a_usage_error():
    torch.manual_seed(0)
    model, args, _ = zoo.mlp(batch=8)
    step = graphopt.train_step(model, args)
    with pytest.raises(graphopt.UsageError, match="loss_fn"):
        step(*args)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(graphopt.UsageError, match="loss_fn"):  # with a budget, when it is built
        graphopt.train_step(model, args, budget_gb=1.0)


@pytest.mark.parametrize("bad", [0, 3, -2, 16, 2.0, "2", True, None])
def test_bad_microbatches_say_what_to_write(bad):
    model, args, kwargs = small_gpt()
    with pytest.raises(graphopt.OptionError, match=r"'auto' .* 1, 2, 4, 8;"):
        graphopt.train_step(model, args, kwargs, microbatches=bad)


def test_bad_arguments():
    model, args, kwargs = small_gpt()
    with pytest.raises(graphopt.OptionError, match="reduction"):
        graphopt.train_step(model, args, kwargs, reduction="avg")
    with pytest.raises(graphopt.UsageError, match="loss_fn must be"):
        graphopt.train_step(model, args, kwargs, loss_fn="cross_entropy")
    with pytest.raises(graphopt.OptionError, match="train="):
        graphopt.train_step(model, args, kwargs, train=False)
    with pytest.raises(graphopt.OptionError, match="stages"):
        graphopt.train_step(model, args, kwargs, stages=2)
    model.eval()
    with pytest.raises(graphopt.UsageError, match="eval mode"):
        graphopt.train_step(model, args, kwargs, budget_gb=1.0)


def test_a_non_scalar_loss_is_a_usage_error():
    torch.manual_seed(0)
    model, args, _ = zoo.mlp(batch=8)
    step = graphopt.train_step(model, args, loss_fn=lambda out, x: out.square(), microbatches=2)
    with pytest.raises(graphopt.UsageError, match="scalar"):
        step(*args)
    assert all(p.grad is None for p in model.parameters())


def test_a_batch_that_does_not_split_is_a_usage_error():
    model, args, kwargs = small_gpt()
    step = graphopt.train_step(model, args, kwargs, microbatches=4)
    model6, args6, kwargs6 = small_gpt(batch=6)
    with pytest.raises(graphopt.UsageError, match="4 equal microbatches"):
        step(*args6, **kwargs6)
    two = graphopt.train_step(model, args, kwargs, microbatches=2)  # no budget: any batch 2 splits
    two(*args6, **kwargs6)
    clear_grads(model)


def test_a_planned_step_takes_its_shapes_only(planned):
    model, args, kwargs, budget, step = planned
    _, args4, kwargs4 = small_gpt(batch=4)
    with pytest.raises(graphopt.UsageError, match="planned for inputs"):
        step(*args4, **kwargs4)
    # the graph, planned on one microbatch, refuses the full batch, whose step its plan does not fit
    with pytest.raises(graphopt.BudgetError, match="plan was made for other sizes"):
        step.graph(*args, **kwargs)
    assert all(p.grad is None for p in model.parameters())


def test_an_input_that_is_not_a_batch_cannot_be_split():
    torch.manual_seed(0)
    model, args, kwargs = zoo.two_heads("dict", batch=8)
    bias = torch.zeros(3)  # three rows that are not the batch's eight

    with pytest.raises(graphopt.OptionError, match="differ in rows"):
        graphopt.train_step(model, args, {**kwargs, "mask": bias}, microbatches=2)


# -- the real-model corpus ------------------------------------------------------------------------

class _Classifier(torch.nn.Module):
    """A corpus image model called with its targets, which the loss outside it reads: the targets
    are split into microbatches with the images."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, targets):
        return self.model(x)


def _cross_entropy(out, x, targets):
    logits = out if isinstance(out, torch.Tensor) else out[0]
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), targets)


def corpus_step_case(name: str, dropout: bool = False, second: bool = False):
    """(model, args, kwargs, loss_fn) of a corpus model on 8 rows, dropout off unless asked for;
    an image model takes its targets as an argument (bench/train_step_corpus.py uses it too).
    second: the rows of a second batch drawn apart from the example (corpus Case.second)."""
    from corpus import build
    from corpus.case import cross_entropy

    case = build(name).repeated(CORPUS_REPEAT)
    if second:
        case = case.second()
    if not dropout:
        no_dropout(case.model)
    if isinstance(case.loss, cross_entropy):
        return _Classifier(case.model), case.args + (case.loss.targets,), case.kwargs, _cross_entropy
    return case.model, case.args, case.kwargs, None


def has_batchnorm(model) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.realmodels
def test_corpus_train_step_holds_a_quarter_budget(train_step_model):
    model, args, kwargs, loss_fn = corpus_step_case(train_step_model)
    eager = step_peak(model, model, args, kwargs, loss_fn)
    fixed = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(fixed + CORPUS_F * (eager - fixed))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step = graphopt.train_step(model, args, kwargs, loss_fn=loss_fn, budget_gb=budget / GB)
        except graphopt.BudgetError as e:
            assert "any number of equal microbatches" in str(e) and e.min_budget_gb * GB > budget, str(e)
            budget = 1.01 * e.min_budget_gb * GB  # the least it names is a budget it meets, and all below holds there
            caught.clear()
            step = graphopt.train_step(model, args, kwargs, loss_fn=loss_fn, budget_gb=budget / GB)
    assert measured_peak(step, model, args, kwargs) <= budget
    if has_batchnorm(model):
        assert (step.microbatches > 1) == any("BatchNorm" in str(w.message) for w in caught)
        return
    _, want = eager_step(model, args, kwargs, loss_fn)
    _, again = eager_step(model, args, kwargs, loss_fn, seed=1)
    if train_step_model in SAMPLES:  # its draws are its function: microbatches draw apart, as train_step warns
        assert step.microbatches == 1 or any("draw from the RNG" in str(w.message) for w in caught)
        return
    assert rel_error(again, want) == 0, "the model is not deterministic: no_dropout missed a dropout"
    _, got = train_step_grads(step, model, args, kwargs)
    # A gradient that is rounding noise in float32 eager itself (an attention key's bias: softmax
    # ignores it) sums otherwise in microbatches: there the float64 step decides, as in every
    # corpus check (verify.compare).
    _, truth = eager_step(*float64_copy(model, args, kwargs), loss_fn)
    assert compare(want, got, truth, EXACT).max_rel <= EXACT
    # A second batch (other tokens, labels apart from them with -100 here and there): against eager on
    # the full batch where the step gives the full batch's (a loss over counted tokens weighs each
    # microbatch by its count), else on the same microbatches weighed as the step weighs them (a
    # loss_fn outside averaged over each; a model whose calls may draw, its counted tokens' shares).
    _, args, kwargs, _ = corpus_step_case(train_step_model, second=True)
    k = 1 if step.whole else step.microbatches
    weights = None if step.whole else step.weights(*args, **kwargs)
    _, want = eager_step(model, args, kwargs, loss_fn, microbatches=k, weights=weights)
    _, got = train_step_grads(step, model, args, kwargs)
    _, truth = eager_step(*float64_copy(model, args, kwargs), loss_fn, microbatches=k, weights=weights)
    against = "the full batch" if k == 1 else f"its {k} microbatches"
    assert compare(want, got, truth, EXACT).max_rel <= EXACT, f"against eager on {against}"
