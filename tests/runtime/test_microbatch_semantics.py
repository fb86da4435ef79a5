"""A batch run in pieces (train_step's microbatches, a staged graph called with the full batch):
what depends on the batch as a whole is said before the numbers change, BatchNorm can be refused,
both paths draw alike, and losses reduced by mean, by sum or over counted targets give the full
batch's gradients."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphopt
from graphopt.analysis.batch_wide import batch_wide
from graphopt import MicrobatchWarning
from graphopt.testing import zoo

STAGED = "normalize,cse,dce,pipeline{stages=2 microbatches=2}"


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, x, y):
        h = self.norm(self.conv(x)).relu().mean((2, 3))
        return F.cross_entropy(self.head(h), y)


class LabelDropout(nn.Module):
    """Classifier-free guidance's training: a class label replaced by the null class at random."""

    def __init__(self, classes=5, dim=8):
        super().__init__()
        self.embed, self.body = nn.Embedding(classes + 1, dim), nn.Linear(dim, dim)
        self.null = classes

    def forward(self, x, c):
        keep = torch.rand(c.shape) >= 0.3
        c = torch.where(keep, c, torch.full_like(c, self.null))
        return ((self.body(x + self.embed(c))) ** 2).mean()


class SumLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.body(x), y, reduction="sum")


def grads(model) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def assert_close(a: list, b: list, tol=1e-5):
    for x, y in zip(a, b):
        assert float((x - y).abs().max()) <= tol * max(float(y.abs().max()), 1e-12)


def batchnorm_case():
    torch.manual_seed(0)
    return BatchNormNet().train(), (torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,)))


def test_what_depends_on_the_batch_is_found_in_the_graph():
    model, args = batchnorm_case()
    wide = batch_wide(graphopt.trace(model, args))
    assert wide.batch_norms == ("norm (BatchNorm2d)",) and not wide.draws
    assert [(r.kind, r.ignore_index) for r in wide.losses] == [("counted mean", -100)]
    gpt, gargs, gkwargs = zoo.gpt()
    assert batch_wide(graphopt.trace(gpt.train(), gargs, gkwargs)).draws
    assert not batch_wide(graphopt.trace(gpt.eval(), gargs, gkwargs)).draws  # dropout draws in training only
    sums = batch_wide(graphopt.trace(SumLoss(), (torch.randn(4, 8), torch.randint(0, 3, (4,)))))
    assert [r.kind for r in sums.losses] == ["sum"]


@pytest.mark.parametrize("path", ["train_step", "staged"])
def test_batchnorm_in_microbatches_warns_naming_it_or_is_refused(path):
    model, args = batchnorm_case()
    build = (lambda **kw: graphopt.train_step(model, args, microbatches=2, passes="normalize", **kw)) \
        if path == "train_step" else (lambda **kw: graphopt.optimize(model, args, passes=STAGED, **kw))
    with pytest.warns(MicrobatchWarning, match=r"BatchNorm in training \(norm \(BatchNorm2d\)\) normalizes each of the 2 microbatches"):
        built = build()
    report = built.report if path == "train_step" else built.graphopt_report
    assert any("BatchNorm2d" in line for line in report.notes)
    with pytest.raises(graphopt.UsageError, match="GroupNorm or LayerNorm"):
        build(batch_norm="refuse")
    with pytest.raises(graphopt.OptionError, match="batch_norm must be one of"):
        build(batch_norm="ignore")


@pytest.mark.parametrize("make", [zoo.gpt, lambda: (LabelDropout(), (torch.randn(4, 8),), {"c": torch.randint(0, 5, (4,))})],
                         ids=["dropout transformer", "label dropout"])
def test_random_draws_warn_and_both_paths_draw_alike(make):
    """train_step with 2 microbatches and the staged graph called with the full batch run the same
    microbatches one after another: the same draws, so the same loss to the bit; the gradients
    too but where a weight is used twice (the GPT's tied embedding), whose terms autograd adds in
    another order when both microbatches' backward run at once."""
    torch.manual_seed(0)
    model, args, kwargs = make()
    model.train()
    with pytest.warns(MicrobatchWarning, match="draw microbatch after microbatch"):
        step = graphopt.train_step(model, args, kwargs, microbatches=2, passes="normalize,cse,dce")
    with pytest.warns(MicrobatchWarning, match="draw from the RNG"):
        staged = graphopt.optimize(model, args, example_kwargs=kwargs, passes=STAGED)
    torch.manual_seed(1)
    loss = step(*args, **kwargs)
    by_step = grads(model)
    torch.manual_seed(1)
    out = staged(*args, **kwargs)
    staged_loss = out if isinstance(out, torch.Tensor) else out.loss
    staged_loss.backward()
    assert torch.equal(loss, staged_loss.detach())
    assert_close(by_step, grads(model), tol=1e-6)


def padded_llama():
    """Token labels with -100 spread unevenly: the first microbatch counts 12 targets, the second 60."""
    torch.manual_seed(0)
    model, args, kwargs = zoo.llama(batch=4, seq=18)
    labels = kwargs["targets"].clone()
    labels[:2, 3:] = -100
    return model.train(), args, {"targets": labels}


def eager_full_batch(model, args, kwargs):
    out = model(*args, **kwargs)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    return loss.detach(), grads(model)


@pytest.mark.parametrize("make", [padded_llama, lambda: (SumLoss(), (torch.randn(6, 8), torch.randint(0, 3, (6,))), {})],
                         ids=["mean over counted tokens", "sum"])
def test_losses_combine_into_the_full_batch_s_through_both_paths(make):
    model, args, kwargs = make()
    want_loss, want = eager_full_batch(model, args, kwargs)
    step = graphopt.train_step(model, args, kwargs, microbatches=2)
    assert step.reduction in ("counted mean", "sum")
    loss = step(*args, **kwargs)
    assert_close([loss], [want_loss])
    assert_close(grads(model), want)
    staged = graphopt.optimize(model, args, example_kwargs=kwargs, passes=STAGED)
    out = staged(*args, **kwargs)
    (out if isinstance(out, torch.Tensor) else out.loss).backward()
    assert_close(grads(model), want)


def test_a_declared_reduction_must_agree_with_the_graph_s():
    model, args = SumLoss(), (torch.randn(4, 8), torch.randint(0, 3, (4,)))
    with pytest.raises(graphopt.OptionError, match="a sum over the batch"):
        graphopt.train_step(model, args, microbatches=2, reduction="mean")


def test_in_eval_the_staged_graph_s_loss_is_the_full_batch_s():
    """Evaluation reports the loss too: a mean over counted tokens combines by their counts there as well."""
    model, args, kwargs = padded_llama()
    staged = graphopt.optimize(model, args, example_kwargs=kwargs, passes=STAGED, train=False)
    with torch.no_grad():
        want, got = model(*args, **kwargs), staged(*args, **kwargs)
    want, got = (v if isinstance(v, torch.Tensor) else v.loss for v in (want, got))
    assert_close([got], [want])


def sum_loss_case():
    torch.manual_seed(0)
    return SumLoss(), (torch.randn(6, 8), torch.randint(0, 3, (6,))), {}


def _runner_rank(rank, world, make):
    from graphopt.runtime.pipeline import PipelineRunner

    model, args, kwargs = make()
    staged = graphopt.optimize(model, args, example_kwargs=kwargs, passes=STAGED)
    runner = PipelineRunner(staged, rank, world, "cpu", example_args=args, example_kwargs=kwargs,
                            loss_fn=lambda out, target: out if isinstance(out, torch.Tensor) else out.loss)
    runner.step(*args, **kwargs)
    runner.sync_tied_grads()
    names = {id(p): n for n, p in model.named_parameters()}
    return runner.loss, runner.reduction, {names[id(p)]: p.grad for p in runner.parameters() if p.grad is not None}


@pytest.mark.parametrize("make", [padded_llama, pytest.param(sum_loss_case, marks=pytest.mark.slow)],
                         ids=["mean over counted tokens", "sum"])
def test_the_pipeline_runner_s_gradients_are_the_full_batch_s(make):
    """torch's schedules scale by 1/M, a mean of the microbatches' losses: the runner weighs a sum's
    and a counted mean's as train_step does (gradients 2.2 relative off for the padded Llama before)."""
    from graphopt.testing.gloo import on_gloo_ranks

    ranks = on_gloo_ranks(_runner_rank, 2, make)
    model, args, kwargs = make()
    want_loss, want = eager_full_batch(model, args, kwargs)
    names = [n for n, _ in model.named_parameters()]
    got = {}
    for _, reduction, part in ranks:
        assert reduction in ("counted mean", "sum")
        got.update(part)
    assert sorted(got) == sorted(names)
    assert_close([got[n] for n in names], want)
    assert ranks[0][0] is None and ranks[1][0] is not None
    assert_close([ranks[1][0]], [want_loss])


def _refused_rank(rank, world):
    from graphopt.runtime.pipeline import PipelineRunner

    model, args, kwargs = padded_llama()
    staged = graphopt.optimize(model, args, example_kwargs=kwargs,
                               passes="pipeline{stages=2 microbatches=2 schedule=interleaved-1f1b ranks=1}")
    texts = []
    for reduction, scale in ((None, 2.0), ("mean", 1.0)):
        runner = PipelineRunner(staged, rank, world, "cpu", example_args=args, example_kwargs=kwargs,
                                loss_fn=lambda out, target: out * scale if scale != 1.0 else out, reduction=reduction)
        with pytest.raises(graphopt.UsageError) as e:
            runner.step(*args, **kwargs)
        texts.append(str(e.value))
    return texts


@pytest.mark.slow  # a gloo launch: make test-real
def test_the_pipeline_runner_refuses_weights_it_would_guess():
    """A loss_fn whose tensor is not the graph's loss over counted tokens, and a declared reduction
    the graph's loss does not have."""
    from graphopt.testing.gloo import on_gloo_ranks

    hidden, declared = on_gloo_ranks(_refused_rank, 1)[0]
    assert "loss_fn returns another tensor" in hidden and "reduction=" in hidden
    assert "reduction='mean', but loss_fn returns the model's loss" in declared
