"""verify=True (verification/verify.py): each pass held to eager on the example and a second batch."""
import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.testing import zoo


def test_verify_records_errors_per_pass():
    model, args, kwargs = zoo.gpt()
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, verify=True)
    report = opt.graphopt_report
    # on CPU every default pass runs but fuse, and the report says why fuse did not
    assert [r.name for r in report.passes] == [p for p in graphopt.DEFAULT_PASSES if p != "fuse"]
    assert list(report.skipped) == ["fuse"] and "CUDA" in report.skipped["fuse"]
    assert "default pass not run: fuse" in report.to_text()
    assert all(r.max_rel_err is not None and r.max_rel_err <= 1e-6 for r in report.passes)


def test_verify_names_the_first_pass_that_changes_numbers():
    from graphopt.passes import Pass, PassResult

    class Scale(Pass):
        """Multiplies the first float output by 1.01: a deliberately wrong rewrite."""

        name = "scale"

        def run(self, gm, ctx):
            out = next(n for n in gm.graph.nodes if n.op == "output")
            first = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
            with gm.graph.inserting_before(out):
                scaled = gm.graph.call_function(torch.mul, (first, 1.01))
            out.replace_input_with(first, scaled)
            return PassResult(gm, True, {})

    model, args, _ = zoo.mlp()
    with pytest.raises(graphopt.VerifyError, match="'scale'") as info:
        graphopt.optimize(model, args, passes=["cse", Scale(), "dce"], verify=True)
    assert info.value.pass_name == "scale"
    assert info.value.errors["max_rel"] > 1e-3


def test_verify_catches_a_pass_right_on_its_example_only():
    from graphopt.passes import Pass, PassResult

    class BakeExample(Pass):
        """Reads the first input's example values as a constant: a rewrite of the kind that is right
        on the batch it was planned on and wrong on every other."""

        name = "bake_example"

        def run(self, gm, ctx):
            x = next(n for n in gm.graph.nodes if n.op == "placeholder")
            gm.register_buffer("baked_example", ctx.example_args[0].clone())
            with gm.graph.inserting_after(x):
                baked = gm.graph.get_attr("baked_example")
            x.replace_all_uses_with(baked, delete_user_cb=lambda user: user is not baked)
            return PassResult(gm, True, {})

    model, args, _ = zoo.mlp()
    with pytest.raises(graphopt.VerifyError, match="'bake_example' changed the numbers on a second batch") as info:
        graphopt.optimize(model, args, passes=["cse", BakeExample(), "dce"], verify=True)
    assert info.value.pass_name == "bake_example"


def test_verify_leaves_model_state_alone():
    model, args, kwargs = zoo.convnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graphopt.optimize(model, args, verify=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_verify_in_bf16_compares_with_autocast():
    # a conv bias in front of a BatchNorm has a gradient that is zero in exact arithmetic: in bf16 it
    # is rounding noise, as it is under torch.autocast
    from graphopt.verification.verify import TOLERANCE, compare, outputs_and_grads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    args = (torch.randn(2, 3, 8, 8),)
    opt = graphopt.optimize(model, args, precision="bf16", verify=True)
    record = next(r for r in opt.graphopt_report.passes if r.name.startswith("precision"))
    assert record.max_rel_err is not None and record.max_rel_err <= TOLERANCE[torch.bfloat16]
    # held to float32 eager instead, the same graph is refused: the bias's noise is all its gradient
    against_eager = compare(outputs_and_grads(model, args, {}, train=True, seed=0),
                            outputs_and_grads(opt, args, {}, train=True, seed=0))
    assert against_eager.worst == "grad[0.bias]" and against_eager.max_rel > TOLERANCE[torch.bfloat16]
