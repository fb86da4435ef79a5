"""graphopt.passes as a whole: the pipeline text, options, the manager, and every pass keeping outputs and gradients."""
import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import passes
from graphopt.passes import parse_pipeline
from graphopt.testing import zoo
from conftest import FX_ZOO, assert_same_step
from pass_cases import Duplicates, run_one_pass


def test_pipeline_text():
    pipeline = parse_pipeline("normalize, cse ,dce")
    assert [p.name for p in pipeline] == ["normalize", "cse", "dce"]
    assert [p.spec() for p in parse_pipeline(["dce", ("cse", {})])] == ["dce", "cse"]
    for bad, match in [("cse{", "unclosed"), ("cse}", "unmatched"), ("cse{x}", "key=value"),
                       ("nope", "available passes: cse, dce, "), ("dce{verbose=1}", "options are: none")]:
        with pytest.raises(graphopt.OptionError, match=match):
            parse_pipeline(bad)


def test_options_are_converted_and_checked():
    from dataclasses import dataclass

    from graphopt.passes import Option, Pass, PassResult
    from graphopt.passes.base import Text, option, to_bool

    @dataclass(frozen=True)
    class DemoOptions:
        k: int = option(2, int, "a count")
        mode: str = option("a", str, "a mode", choices=("a", "b"))
        on: bool = option(False, to_bool, "a switch")

    class Demo(Pass):
        name = "demo-options"
        Options = DemoOptions

        def run(self, gm, ctx):
            return PassResult(gm, False)

    p = Demo(k=Text("5"), on=Text("true"))  # as a pipeline string gives them
    assert p.settings == DemoOptions(k=5, mode="a", on=True) and p.settings.k == 5
    assert p.spec() == "demo-options{k=5,on=True}"
    with pytest.raises(graphopt.OptionError, match="bad value"):
        Demo(k=Text("five"))
    with pytest.raises(graphopt.OptionError, match="a, b"):
        Demo(mode="c")
    # a Python value must already be of the option's type: text is parsed only from pipelines
    with pytest.raises(graphopt.OptionError, match="must be True or False"):
        Demo(on="true")
    with pytest.raises(graphopt.OptionError, match="optimize\\(budget_gb=...\\).*positive, finite"):
        graphopt.optimize(*zoo.mlp()[:2], budget_gb="8")
    with pytest.raises(TypeError, match="frozen dataclass"):  # options as a dict would be dropped silently
        type("Old", (Pass,), {"name": "old-options", "options": {"k": Option(2, int, "a count")}})


@pytest.mark.parametrize("name", FX_ZOO)
@pytest.mark.parametrize("pass_name", ["normalize", "cse", "dce"])
def test_each_pass_keeps_outputs_and_gradients(name, pass_name):
    model, args, kwargs = FX_ZOO[name]()
    opt, _ = run_one_pass(pass_name, model, args, kwargs)
    assert_same_step(model, opt, args, kwargs, exact=False, tol=1e-6)


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_bert"])
def test_default_pipeline_on_transformers(name):
    pytest.importorskip("transformers")
    model, args, kwargs = zoo.HF_ZOO[name]()
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, verify=True)
    assert_same_step(model, opt, args, kwargs, exact=False, tol=1e-6)


@torch.fx.wrap
def mystery(x):
    return x * 2


class Opaque(nn.Module):
    def forward(self, x):
        unused = mystery(x)  # noqa: F841  opaque: may have side effects, stays
        return mystery(x) + mystery(x)


def test_unknown_ops_are_left_alone():
    model, args = Opaque(), (torch.randn(3, requires_grad=True),)
    opt = graphopt.optimize(model, args, verify=True)
    assert len([n for n in opt.graph.nodes if n.target is mystery]) == 3


def test_available_passes_are_all_implemented():
    for name, cls in passes.available().items():
        assert cls.run is not passes.Pass.run, name
        assert cls.__doc__ and cls.name == name


def test_manager_annotates_new_and_invalidated_nodes():
    from graphopt.analysis.meta import invalidate, tensor_info
    from graphopt.passes import Pass, PassResult

    class Widen(Pass):
        """Appends a cat that doubles the output, and retargets the head in place."""

        name = "widen"

        def run(self, gm, ctx):
            out = next(n for n in gm.graph.nodes if n.op == "output")
            head = out.args[0]
            with gm.graph.inserting_before(out):
                cat = gm.graph.call_function(torch.cat, ([head, head],))
            out.replace_input_with(head, cat)
            relu = next(n for n in gm.graph.nodes if n.name == "relu")
            relu.target = torch.sigmoid  # computes something else now
            invalidate(relu)
            return PassResult(gm, True)

    model, args, _ = zoo.mlp(batch=8)
    opt = graphopt.optimize(model, args, passes=[Widen()])
    cat = next(n for n in opt.graph.nodes if n.target is torch.cat)
    assert tensor_info(cat).shape == (16, 10)
    assert tensor_info(next(n for n in opt.graph.nodes if n.name == "relu")) is not None


def test_a_pass_that_must_run_after_another_is_refused_before_it():
    model, args = Duplicates(), (torch.randn(4, 8),)
    with pytest.raises(graphopt.OptionError, match="'inplace' comes before 'precision'.*Put 'precision' first"):
        graphopt.optimize(model, args, passes="inplace,precision{precision=bf16}")
    with pytest.raises(graphopt.OptionError, match="'recompute' comes before 'fuse'"):
        graphopt.optimize(model, args, passes="recompute{budget_gb=1},fuse")


def test_optimize_places_the_passes_its_arguments_ask_for_in_order():
    model, args = Duplicates(), (torch.randn(4, 8),)
    opt = graphopt.optimize(model, args, passes="normalize,inplace", precision="bf16", budget_gb=1.0)
    assert [p.name for p in opt.graphopt_report.passes] == ["normalize", "precision{precision=bf16}", "inplace",
                                                            "recompute{budget_gb=1.0}"]


def test_each_pass_builds_itself_from_the_one_checked_record():
    from graphopt.api import build_pipeline
    from graphopt.api import checked_options

    options = checked_options(dict(budget_gb=2.0, precision="fp16", precision_policy="softmax:fp32", optimizer="sgd"))
    assert options.budget_bytes == 2 * 10**9  # bytes from the entry on
    built = {p.name: p.settings for p in build_pipeline("dce", options)}
    assert (built["recompute"].budget_bytes, built["recompute"].optimizer) == (2 * 10**9, "sgd")
    assert (built["precision"].precision, built["precision"].precision_policy) == ("fp16", "softmax:fp32")
    staged = {p.name: p.settings for p in build_pipeline("dce", checked_options(dict(stages=2, budget_gb=2.0)))}
    # an argument not given leaves its option at the default: each stage holds adam's state
    assert "recompute" not in staged and (staged["pipeline"].budget_bytes, staged["pipeline"].optimizer) == (2 * 10**9,
                                                                                                           "adam")
    with pytest.raises(graphopt.OptionError, match=r"optimize\(budget_gb=...\): bad value -1"):
        checked_options(dict(budget_gb=-1))
    # the pass made from the record and the one a pipeline string names are one pass
    assert parse_pipeline("recompute{budget_gb=2.0 optimizer=sgd}")[0].settings == built["recompute"]


