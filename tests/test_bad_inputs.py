"""Every bad input gets a specific graphopt error; every row that should work equals eager.

The table is what a user gets wrong (or expects to work), row by row, with the exact error
class; the property tests feed random option values and pass strings to optimize() and
accept a graphopt error or a correct result, never another exception.
"""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import graphopt
from graphopt import BudgetError, GraphoptError, ModeError, OptionError, UsageError
from hypothesis_profiles import examples


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


X = torch.randn(4, 8)


class LSTMModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x):
        return self.lstm(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x)[0].sum()


def _optimized(**kwargs):
    return graphopt.optimize(mlp(), (X,), **kwargs)


class WithTargets(nn.Module):
    """A model whose loss is computed when targets are given, and a scale left at its default."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x, targets=None, scale=1.0):
        out = self.lin(x) * scale
        return out if targets is None else nn.functional.cross_entropy(out, targets)


class Casting(nn.Module):
    """A linear's output cast to float32, as HF's norms cast theirs: torch.export checks its dtype."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x).to(torch.float32).relu()


def _under_autocast():
    opt = graphopt.optimize(Casting(), (X,), frontend="export")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return opt(X)


def _with_targets(frontend="fx"):
    return graphopt.optimize(WithTargets(), (X,), example_kwargs={"targets": torch.randint(0, 4, (4,))},
                             frontend=frontend)


def _planned():
    """A deep MLP with a recompute plan at a budget just above the least one, batch 2048."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), *[m for _ in range(4) for m in (nn.Tanh(), nn.Linear(64, 64))])
    x = torch.randn(2048, 8)
    try:
        graphopt.optimize(model, (x,), budget_gb=1e-9)
    except BudgetError as e:
        opt = graphopt.optimize(model, (x,), budget_gb=e.min_budget_gb * 1.01)
    assert opt.graphopt_report.passes[-1].stats["segments"] > 0
    return opt


def _mse(out, x):
    return out.pow(2).mean()


def _step(**kwargs):
    return graphopt.train_step(mlp(), (X,), loss_fn=kwargs.pop("loss_fn", _mse), **kwargs)


def _eval_step(**kwargs):
    model = mlp().eval()
    return graphopt.train_step(model, (X,), loss_fn=_mse, **kwargs)


def _file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("")
    return str(path)


def _save(module):
    torch.save(module, io.BytesIO())


# id -> (what the user does, given pytest's tmp_path; the error it must raise)
ERRORS = {
    "model is a function": (lambda tmp: graphopt.optimize(lambda x: x, (X,)), UsageError),
    "inputs do not fit forward()": (lambda tmp: graphopt.optimize(mlp(), (X, X)), UsageError),
    "example_inputs of another kind": (lambda tmp: graphopt.optimize(mlp(), {"x": X}), UsageError),
    "budget_gb=nan": (lambda tmp: _optimized(budget_gb=float("nan")), OptionError),
    "budget_gb=inf": (lambda tmp: _optimized(budget_gb=float("inf")), OptionError),
    "budget_gb=-1": (lambda tmp: _optimized(budget_gb=-1), OptionError),
    "budget_gb='8'": (lambda tmp: _optimized(budget_gb="8"), OptionError),
    "budget_gb=True": (lambda tmp: _optimized(budget_gb=True), OptionError),
    "budget_gb too small": (lambda tmp: _optimized(budget_gb=1e-9), BudgetError),
    "budget_gb too small, attention": (
        lambda tmp: graphopt.optimize(Attention(), (torch.randn(2, 8, 16),), budget_gb=1e-6), BudgetError),
    "budget_gb too small, LSTM": (
        lambda tmp: graphopt.optimize(LSTMModel(), (torch.randn(2, 5, 8),), budget_gb=1e-6), BudgetError),
    "budget_gb=nan in a pass string": (lambda tmp: _optimized(passes="recompute{budget_gb=nan}"), OptionError),
    "stages=0": (lambda tmp: _optimized(stages=0), OptionError),
    "stages=2.0": (lambda tmp: _optimized(stages=2.0), OptionError),
    "passes=42": (lambda tmp: _optimized(passes=42), OptionError),
    "passes={'cse': {}}": (lambda tmp: _optimized(passes={"cse": {}}), OptionError),
    "unknown pass": (lambda tmp: _optimized(passes="cse,nope"), OptionError),
    "unclosed options": (lambda tmp: _optimized(passes="recompute{budget_gb=1"), OptionError),
    "unknown option": (lambda tmp: _optimized(passes="fuse{speed=3}"), OptionError),
    "precision='int8'": (lambda tmp: _optimized(precision="int8"), OptionError),
    "frontend='jit'": (lambda tmp: _optimized(frontend="jit"), OptionError),
    "train='yes'": (lambda tmp: _optimized(train="yes"), OptionError),
    "verify='yes'": (lambda tmp: _optimized(verify="yes"), OptionError),
    "profile=1": (lambda tmp: _optimized(budget_gb=1, profile=1), OptionError),
    "calibrate without budget_gb": (lambda tmp: _optimized(calibrate=True), OptionError),
    "optimizer='lion'": (lambda tmp: _optimized(budget_gb=1, optimizer="lion"), OptionError),
    "accumulate without budget_gb": (lambda tmp: _optimized(accumulate=True), OptionError),
    "accumulate='yes'": (lambda tmp: _optimized(budget_gb=1, accumulate="yes"), OptionError),
    "accumulate with stages": (lambda tmp: _optimized(budget_gb=1, stages=2, accumulate=True), OptionError),
    "budget_gb twice": (lambda tmp: _optimized(budget_gb=1, passes="recompute{budget_gb=1}"), OptionError),
    "dump_dir names a file": (lambda tmp: _optimized(dump_dir=_file(tmp)), UsageError),
    "dump_dir=42": (lambda tmp: _optimized(dump_dir=42), UsageError),
    "called with too many arguments": (lambda tmp: _optimized()(X, X), UsageError),
    "called with an unknown keyword": (lambda tmp: _optimized()(X, mask=X), UsageError),
    "fx graph traced with targets, called with targets=None": (lambda tmp: _with_targets()(X, targets=None),
                                                                UsageError),
    "fx graph traced with targets, called without": (lambda tmp: _with_targets()(X), UsageError),
    "fx graph, float64 inputs": (lambda tmp: _optimized()(X.double()), UsageError),
    "fx graph, a default it baked in given another value": (
        lambda tmp: _with_targets()(X, targets=torch.zeros(4, dtype=torch.long), scale=2.0), UsageError),
    "export graph traced with targets, called with targets=None": (
        lambda tmp: _with_targets("export")(X, targets=None), UsageError),
    "export graph, another feature size": (lambda tmp: _optimized(frontend="export")(torch.randn(4, 9)), UsageError),
    "export graph, another feature size at another batch": (
        lambda tmp: _optimized(frontend="export")(torch.randn(1, 9)), UsageError),
    "export graph with a cast, called under torch.autocast": (lambda tmp: _under_autocast(), UsageError),
    "recompute plan, a larger batch than its budget takes": (lambda tmp: _planned()(torch.randn(4096, 8)),
                                                             BudgetError),
    "built for training, run in eval": (lambda tmp: _optimized(train=True).eval()(X), ModeError),
    "torch.save": (lambda tmp: _save(_optimized()), UsageError),
    "torch.save with fused groups": (lambda tmp: _save(_optimized(passes="normalize,fuse")), UsageError),
    "torch.save of the lazy form": (lambda tmp: _save(graphopt.optimize(mlp())), UsageError),
    "train_step of a function": (lambda tmp: graphopt.train_step(lambda x: x, (X,)), UsageError),
    "train_step, no loss and no loss_fn": (lambda tmp: graphopt.train_step(mlp(), (X,))(X), UsageError),
    "train_step, loss_fn=3": (lambda tmp: _step(loss_fn=3), UsageError),
    "train_step, a loss that is not a scalar": (lambda tmp: _step(loss_fn=lambda out, x: out)(X), UsageError),
    "train_step, a loss without grad": (lambda tmp: _step(loss_fn=lambda out, x: out.detach().sum())(X),
                                        UsageError),
    "train_step, budget_gb=nan": (lambda tmp: _step(budget_gb=float("nan")), OptionError),
    "train_step, budget_gb='8'": (lambda tmp: _step(budget_gb="8"), OptionError),
    "train_step, budget_gb too small": (lambda tmp: _step(budget_gb=1e-9), BudgetError),
    "train_step, microbatches=3 of 4 rows": (lambda tmp: _step(microbatches=3), OptionError),
    "train_step, microbatches='two'": (lambda tmp: _step(microbatches="two"), OptionError),
    "train_step, reduction='max'": (lambda tmp: _step(reduction="max"), OptionError),
    "train_step, stages=2": (lambda tmp: _step(stages=2), OptionError),
    "train_step, train=False": (lambda tmp: _step(train=False), OptionError),
    "train_step, a budget in eval mode": (lambda tmp: _eval_step(budget_gb=1), UsageError),
    "train_step, microbatches that do not split the call": (lambda tmp: _step(microbatches=2)(X[:3]), UsageError),
    "train_step planned, another batch size": (lambda tmp: _step(budget_gb=1)(torch.randn(8, 8)), UsageError),
    "train_step, optimizer='lion'": (lambda tmp: _step(optimizer="lion"), OptionError),
    "train_step, accumulate=True": (lambda tmp: _step(budget_gb=1, accumulate=True), OptionError),
}


@pytest.mark.parametrize("row", ERRORS)
def test_bad_input_raises_its_graphopt_error(row, tmp_path):
    do, expected = ERRORS[row]
    with pytest.raises(GraphoptError) as caught:
        do(tmp_path)
    assert type(caught.value) is expected, f"{row}: {type(caught.value).__name__}: {caught.value}"
    assert "failed on" not in str(caught.value)  # the pass manager's wrapper is for real bugs


def test_budget_error_names_the_least_budget():
    with pytest.raises(BudgetError) as caught:
        _optimized(budget_gb=1e-9)
    assert caught.value.min_budget_gb > 1e-9
    graphopt.optimize(mlp(), (X,), budget_gb=caught.value.min_budget_gb * 1.001)


def _same(model, opt, *args, tol=1e-6):
    torch.manual_seed(0)
    want = model(*args)
    torch.manual_seed(0)
    got = opt(*args)
    want_leaves, want_spec = torch.utils._pytree.tree_flatten(want)
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    assert got_spec == want_spec, f"outputs of another structure: {got_spec} vs {want_spec}"
    for w, g in zip(want_leaves, got_leaves):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)


def test_eval_mode_export_graph_runs():
    model = mlp().eval()
    opt = graphopt.optimize(model, (X,), frontend="export")
    assert not opt.training
    _same(model, opt, X)


def test_dump_of_nested_tuple_outputs(tmp_path):
    model, x = LSTMModel(), torch.randn(2, 5, 8)
    opt = graphopt.optimize(model, (x,), dump_dir=tmp_path)
    assert any(p.suffix == ".txt" for p in tmp_path.iterdir())
    _same(model, opt, x)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_refused_save_to_a_path_leaves_no_file(tmp_path, lazy):
    opt = graphopt.optimize(mlp()) if lazy else graphopt.optimize(mlp(), (X,))
    path = tmp_path / "opt.pt"
    with pytest.raises(UsageError, match="state_dict"):
        torch.save(opt, path)
    with pytest.raises(UsageError, match="state_dict"):
        torch.save(opt, str(path), _use_new_zipfile_serialization=False)
    assert not path.exists() and not list(tmp_path.iterdir())


def test_state_dict_and_optimize_again_is_the_way_to_save():
    model = mlp()
    opt = graphopt.optimize(model, (X,), passes="normalize,fuse")
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    fresh = mlp()
    for p in fresh.parameters():
        nn.init.zeros_(p)
    fresh.load_state_dict(torch.load(buffer))
    _same(model, graphopt.optimize(fresh, (X,), passes="normalize,fuse"), X, tol=1e-5)


def test_deepcopy_still_works():
    opt = _optimized()
    _same(opt, copy.deepcopy(opt), X)


# Random arguments: a graphopt error or a correct result, never another exception.
NUMBERS = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3),
                    st.sampled_from(["8", "", True, [1]]))
PASS_TOKENS = st.sampled_from(["normalize", "cse", "dce", "fuse", "inplace", "recompute{budget_gb=1}",
                               "recompute{budget_gb=-1}", "precision{precision=bf16}", "precision{precision=int4}",
                               "fuse{", "}", "=", "nope", "cse{x=1}", "dce{}", " ", ""])


@settings(max_examples=examples(40))
@given(budget=NUMBERS, precision=st.sampled_from([None, "bf16", "fp16", "fp32", "fp8", 16, ""]),
       stages=st.sampled_from([None, 0, 1.5, "2", -1]), train=st.sampled_from([None, True, False, "no"]))
def test_random_arguments(budget, precision, stages, train):
    _graphopt_error_or_same(dict(budget_gb=budget, precision=precision, stages=stages, train=train))


@settings(max_examples=examples(40))
@given(tokens=st.lists(PASS_TOKENS, max_size=4), joiner=st.sampled_from([",", ", ", ";"]))
def test_random_pass_strings(tokens, joiner):
    _graphopt_error_or_same(dict(passes=joiner.join(tokens)))


def _graphopt_error_or_same(kwargs):
    model = mlp()
    try:
        opt = graphopt.optimize(model, (X,), **kwargs)
    except GraphoptError as e:
        assert "failed on" not in str(e), e  # a pass crashing is a bug, not a bad input
        return
    low = kwargs.get("precision") in ("bf16", "fp16") or "precision{precision=bf16}" in str(kwargs.get("passes"))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
        want = model(X)
    got = opt(X)
    tol = 2e-2 if low else 1e-5
    assert math.isclose(float((got.float() - want.float()).abs().max()), 0.0, abs_tol=tol)


def test_a_baked_default_given_again_is_taken():
    # the fx graph bakes scale=1.0 in (its forward takes no scale): the same value given is dropped
    model, targets = WithTargets(), torch.randint(0, 4, (4,))
    opt = graphopt.optimize(model, (X,), example_kwargs={"targets": targets}, frontend="fx")
    assert torch.equal(opt(X, targets, 1.0), model(X, targets, 1.0))
    assert torch.equal(opt(X, targets=targets, scale=1.0), model(X, targets=targets))
