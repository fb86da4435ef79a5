"""Every pass exact on the real-model corpus (tests/corpus): transformers, timm and torchvision
models nobody on the project wrote, trained the way their users train them.

`make test` runs the checks on corpus.QUICK and corpus.REGRESSIONS; `make test-real` (pytest
--corpus=all -m "realmodels or slow") every check on every model, every pair of passes on six,
and the slow tests. What each check compares, and how, is in corpus/checks.py.
"""
import pytest
import torch

import graphopt
from graphopt.passes.recompute.rewrite import recomputable

from corpus import REGRESSIONS, build
from corpus.checks import CHECKS, PAIR_PASSES, run, step

pytestmark = pytest.mark.realmodels


def pytest_generate_tests(metafunc):
    scope = metafunc.config.getoption("--corpus")
    if "regression" in metafunc.fixturenames:
        metafunc.parametrize("regression", [] if scope == "all" else REGRESSIONS, ids="-".join)
    if "pair_model" in metafunc.fixturenames:
        metafunc.parametrize("pair_model", PAIR_MODELS[scope])


@pytest.mark.parametrize("check", CHECKS)
def test_each_pass_is_exact_on_the_model(corpus_model, check):
    result = run(corpus_model, check)
    assert result.passed, f"{corpus_model} {check}: {result.cell()}: {result.detail}"


def test_the_check_that_once_failed(regression):
    name, check = regression
    result = run(name, check)
    assert result.passed, f"{name} {check}: {result.cell()}: {result.detail}"


# The pairs (56 per model) run in make test-real alone, on models of each frontend.
PAIR_MODELS = {"quick": (),
               "all": ("hf_gpt2", "hf_t5", "hf_llama", "timm_mobilenetv3_small_100", "timm_levit_128s", "tv_swin_t")}
PAIRS = [(a, b) for a in PAIR_PASSES for b in PAIR_PASSES if a != b]


@pytest.mark.parametrize("first,second", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_every_pair_of_passes_composes_or_is_refused(pair_model, first, second):
    result = run(pair_model, "pair", first, second)
    assert result.passed, f"{pair_model} passes={first},{second}: {result.cell()}: {result.detail}"


# Models whose in-place activations (nn.ReLU/SiLU(inplace=True)) and torch._assert once made every
# node "not recomputable"; a BatchNorm written in Python (timm's BatchNormAct2d) counts its
# calls in a buffer, a real state write.
INPLACE_ACTIVATIONS = ("timm_resnext26ts", "timm_efficientnet_b0", "timm_densenet121", "timm_regnetx_002",
                       "timm_nfnet_l0")


@pytest.mark.parametrize("name", INPLACE_ACTIVATIONS)
def test_in_place_activations_and_asserts_block_nothing(name):
    case = build(name)
    opt = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes="normalize,cse,dce")
    assert sum(opt.graphopt_report.passes[0].stats["functionalized"].values()) > 0
    blocked = {n.name: why for n in opt.graph.nodes if n.op.startswith("call") and (why := recomputable(n, opt))}
    # what is left: the num_batches_tracked counters, each written from its attribute alone
    assert all(n.op == "call_method" and all(i.op == "get_attr" for i in n.all_input_nodes)
               for n in opt.graph.nodes if n.name in blocked), blocked
    assert all(why == "add_ writes state" for why in blocked.values())


def test_inplace_with_bf16_computes_what_precision_alone_does():
    # inplace once ran first and wrote the float32 residual stream into bf16 tensors (GPT-2)
    case = build("hf_gpt2")
    alone = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes="normalize,cse,dce",
                              precision="bf16")
    both = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes="normalize,cse,dce,inplace",
                             precision="bf16")
    assert [p.name for p in both.graphopt_report.passes][-2:] == ["precision{precision=bf16}", "inplace"]
    assert both.graphopt_report.passes[-1].stats["rewritten"]
    expected, got = step(alone, case), step(both, case)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.slow
def test_verify_holds_fused_kernels_to_float32s_own_accuracy():
    # BatchNorm biases in front of another BatchNorm have gradients of pure rounding noise:
    # compared plainly, a fused SE block "changed" them 140%; against float64 it is as close as eager
    case = build("timm_mobilenetv3_small_100")
    opt = graphopt.optimize(case.model, case.args, passes="fuse", verify=True)
    assert opt.graphopt_report.passes[-1].max_rel_err <= 1e-4


@pytest.mark.parametrize("name", ["hf_bert", "hf_t5", pytest.param("timm_resnet18", marks=pytest.mark.slow)])
def test_verify_holds_bf16_to_autocasts_accuracy(name):
    # compared with float32 eager, bf16 BERT, T5 and a BatchNorm convnet "changed the numbers"
    # although they equal torch.autocast; against autocast they pass
    case = build(name)
    opt = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, precision="bf16", verify=True)
    assert opt.graphopt_report.passes[-1].max_rel_err <= 5e-2
