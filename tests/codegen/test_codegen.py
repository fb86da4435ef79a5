"""The fused-group codegen without running kernels: the IR's checks, dtypes against eager torch,
what is declined, layouts, structural keys, and the shape of the generated source."""
import re

import pytest
import torch

from graphopt.codegen import Group, Step, Unsupported, step_dtypes, supports
from graphopt.codegen.layout import collapse, expanded_strides
from graphopt.codegen.spec import plan_backward, plan_forward
from graphopt.runtime import source

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def meta(*shape, dtype=F32, strides=None):
    if strides is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.empty_strided(shape, strides, dtype=dtype, device="meta")


def chain(*ops, inputs=1):
    """op0(input 0 [, input 1]) -> op1 -> ...: the first op takes all inputs."""
    steps = [Step(ops[0], tuple(("input", k) for k in range(inputs)))]
    steps += [Step(op, (("step", j),)) for j, op in enumerate(ops[1:])]
    return Group([f"x{k}" for k in range(inputs)], steps, [len(steps) - 1], origin=[f"node_{op}" for op in ops])


@pytest.mark.parametrize("steps, outputs, message", [
    ([Step("no_such_op", (("input", 0),))], [0], "unknown op"),
    ([Step("sum", (("input", 0),))], [0], "only elementwise"),
    ([Step("bitwise_and", (("input", 0), ("input", 0)))], [0], "no Triton template"),
    ([Step("relu_", (("input", 0),))], [0], "out-of-place form relu"),
    ([Step("add", (("input", 0),))], [0], "takes 2"),
    ([Step("neg", (("step", 0),))], [0], "not an step before it"),
    ([Step("neg", (("input", 3),))], [0], "not an input"),
    ([Step("neg", (torch.ones(2),))], [0], "make tensors group inputs"),
    ([Step("add", (1.0, 2.0))], [0], "only scalar args"),
    ([Step("neg", (("input", 0),), {"beta": 2})], [0], "unknown params"),
    ([Step("pow_scalar", (("input", 0),))], [0], "needs params ['exponent']"),
    ([Step("neg", (("input", 0),))], [1], "not a step index"),
    ([Step("neg", (("input", 0),))], [0, 0], "list a step twice"),
])
def test_malformed_groups_raise_a_sentence_saying_what_to_do(steps, outputs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Group(["x"], steps, outputs)


# each case: the group's only step (inputs as ("input", k)), its inputs, and the eager call
PROMOTION = [
    (Step("mul", (("input", 0), 3)), [meta(2, dtype=F16)], lambda x: x * 3),
    (Step("add", (("input", 0), ("input", 1))), [meta(2, dtype=F16), torch.empty((), device="meta")], torch.add),
    (Step("add", (("input", 0), ("input", 1))), [meta(2, dtype=F16), meta(2)], torch.add),
    (Step("add", (("input", 0), ("input", 1))), [meta(2, dtype=F16), meta(2, dtype=BF16)], torch.add),
    (Step("mul", (("input", 0), 0.5)), [meta(2, dtype=torch.bool)], lambda m: m * 0.5),
    (Step("where", (("input", 0), ("input", 1), 0.0)), [meta(2, dtype=torch.bool), meta(2, dtype=BF16)],
     lambda c, x: torch.where(c, x, 0.0)),
    (Step("lt", (("input", 0), ("input", 1))), [meta(2, dtype=F16), meta(2)], torch.lt),
    (Step("isnan", (("input", 0),)), [meta(2, dtype=BF16)], torch.isnan),
    (Step("to_dtype", (("input", 0),), {"dtype": torch.int32}), [meta(2)], lambda x: x.to(torch.int32)),
    (Step("to_dtype", (("input", 0),), {"dtype": F16}), [meta(2, dtype=torch.int64)], lambda x: x.to(F16)),
]


@pytest.mark.parametrize("step, inputs, eager", PROMOTION)
def test_step_dtypes_follow_torch_promotion(step, inputs, eager):
    group = Group([f"x{k}" for k in range(len(inputs))], [step], [0])
    assert step_dtypes(group, inputs) == [eager(*inputs).dtype]


@pytest.mark.parametrize("step, inputs, reason", [
    (Step("neg", (("input", 0),)), [meta(2, dtype=torch.float64)], "float64"),
    (Step("add", (("input", 0), 1)), [meta(2, dtype=torch.int64)], "computes on int64 values"),
    (Step("remainder", (("input", 0), ("input", 1))), [meta(2, dtype=torch.int32), meta(2, dtype=torch.int32)], "//"),
    (Step("eq", (("input", 0), 3)), [meta(2, dtype=torch.int64)], "int64"),
    (Step("add", (("input", 0), ("input", 0))), [meta(2, dtype=torch.bool)], "computes in bool"),
    (Step("to_dtype", (("input", 0),), {"dtype": torch.float64}), [meta(2)], "casts to float64"),
])
def test_declined_groups_say_why(step, inputs, reason):
    group = Group([f"x{k}" for k in range(len(inputs))], [step], [0])
    with pytest.raises(Unsupported, match=reason):
        step_dtypes(group, inputs)
    assert reason in supports(group, inputs)
    assert supports(group) is None  # structurally fine: only these dtypes are declined


def test_layouts_merge_dims_drop_size_one_and_mark_broadcast():
    full = (8, 1, 4, 6)
    x = expanded_strides((8, 1, 4, 6), (24, 24, 6, 1), full)  # contiguous
    b = expanded_strides((6,), (1,), full)  # a bias
    t = expanded_strides((8, 1, 4, 6), (1, 1, 48, 8), full)  # permuted
    lay = collapse(full, [x, b])
    assert lay.sizes == (32, 6) and lay.pattern(0) == "flat" and lay.pattern(1) == (0, 1)
    lay = collapse(full, [x, t])
    assert lay.sizes == (8, 24) and lay.pattern(1) == (1, "s")  # its last two dims still step as one
    assert collapse((), [()]).pattern(0) == "flat"


def key(group, *inputs):
    return plan_forward(group, list(inputs)).spec


def test_the_kernel_key_is_structural_not_sized():
    group = chain("add", "gelu", inputs=2)
    base = key(group, meta(4, 16, 32), meta(32))
    assert key(group, meta(7, 3, 32), meta(32)) == base  # another batch and sequence length
    assert key(group, meta(4, 16, 32, dtype=F16), meta(32)) != base  # dtype
    assert key(group, meta(4, 16, 32), meta(16, 1)) != base  # broadcast pattern
    assert key(group, meta(4, 16, 32, strides=(1, 128, 4)), meta(32)) != base  # layout
    assert key(group, meta(4, 16, 32), torch.empty((), device="meta")) != base
    # scalars of equal value but another type promote differently; -0.0 is not 0.0
    for a, b in [(1, 1.0), (1, True), (0.0, -0.0)]:
        ga, gb = (Group(["x"], [Step("mul", (("input", 0), s))], [0]) for s in (a, b))
        assert key(ga, meta(4)) != key(gb, meta(4))


def test_int64_offsets_when_an_offset_can_pass_2_31():
    group = chain("neg")
    assert not key(group, meta(2**30)).index64
    assert key(group, meta(2**31)).index64
    assert key(group, meta(2, 2**30, strides=(2**30 + 5, 1))).index64  # numel 2**31 too, but the offset alone
    assert key(group, meta(4, 2, strides=(2**30, 1))).index64  # few elements, a huge stride


def test_backward_key_records_which_gradients_flow():
    group = Group(["x", "y"], [Step("mul", (("input", 0), ("input", 1))), Step("exp", (("step", 0),))], [1, 0])
    inputs = [meta(4, 8), meta(8)]
    grads = [meta(4, 8), meta(4, 8)]
    both, program = plan_backward(group, inputs, grads, [True, True])
    assert program.grads == (0, 1)
    one, program = plan_backward(group, inputs, [grads[0], None], [True, False])
    assert program.grads == (0,) and one.spec != both.spec
    _, program = plan_backward(group, inputs, [None, None], [True, True])
    assert program.grads == ()


TL_SAFE = {"exp", "log", "sqrt", "rsqrt", "abs", "where", "maximum", "minimum", "sigmoid", "erf", "floor", "ceil",
           "sin", "cos", "load", "store", "arange", "program_id", "jit", "constexpr", "float32", "float16", "bfloat16",
           "int1", "int32", "int64", "uint32"}


def test_generated_source_follows_the_checklist():
    group = Group(["x", "b", "m"], [Step("add", (("input", 0), ("input", 1))), Step("gelu_tanh", (("step", 0),)),
                                    Step("masked_fill", (("step", 1), ("input", 2), float("-inf"))),
                                    Step("to_dtype", (("step", 2),), {"dtype": BF16})], [3, 0],
                  origin=["add_3", "gelu_1", "masked_fill", "to_1"])
    forward, backward = source(group, [(8, 4, 16), (16,), (8, 1, 16)], [F16, F32, torch.bool],
                               strides=[(1, 128, 8), None, None])
    for src in (forward, backward):
        assert src.startswith("# graphopt fused") and "# from: add_3, gelu_1, masked_fill, to_1" in src
        assert "add -> gelu_tanh -> masked_fill -> to_dtype" in src
        assert "BLOCK: tl.constexpr" in src and "mask = offs < n" in src
        assert "offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)" in src
        assert "libdevice" not in src and "math." not in src
        assert set(re.findall(r"\btl\.(\w+)", src)) <= TL_SAFE
        assert "x1_ptr + i" in src and "_stride" in src  # the bias broadcasts; the permuted input strides
        assert ".to(tl.float32)" in src  # half loads are upcast
        compile(src, "kernel", "exec")
    assert "round_bf16(v3).to(tl.bfloat16)" in forward and "float(\"-inf\")" in forward
    assert "tl.store(d0_ptr + offs, d0.to(tl.float16)" in backward  # x spans the group: no reduction
    assert "tl.store(d1_ptr + offs, d1, mask=mask)" in backward  # the bias: fp32, summed after


def test_backward_recomputes_only_what_the_derivatives_read():
    # mul's derivatives read the operands, not the exp after it: exp is not recomputed
    group = Group(["x", "y"], [Step("mul", (("input", 0), ("input", 1))), Step("neg", (("step", 0),)),
                               Step("add", (("step", 1), 1.0))], [2])
    _, backward = source(group, [(4,), (4,)], [F32, F32])
    assert "v0 =" not in backward and "v1 =" not in backward and "v2 =" not in backward
    assert "x0 = tl.load" in backward and "x1 = tl.load" in backward


def test_a_group_without_float_inputs_has_no_backward():
    group = Group(["m"], [Step("logical_not", (("input", 0),))], [0])
    forward, backward = source(group, [(4,)], [torch.bool])
    assert backward is None and "!= 0" in forward


def test_half_steps_round_where_eager_rounds():
    """Each fp16 step is rounded, in the forward and in the backward's recomputed forward, and so is
    each gradient term; fp32 code rounds nothing."""
    group = chain("add", "sigmoid", "square", inputs=2)
    forward, backward = source(group, [(4, 8), (8,)], [F16, F16])
    for src in (forward, backward):
        assert "v0 = round_fp16(" in src and "v1 = round_fp16(" in src
        assert "def round_fp16(x):" in src and "def round_bf16" not in src
    assert "v2 = round_fp16(" in forward
    assert "a1 = round_fp16(2.0 * (a2) * (v1))" in backward and "d1 = round_fp16((1) * (a0))" in backward
    assert "round_" not in source(group, [(4, 8), (8,)], [F32, F32])[0]
    assert "v2 = round_bf16(" in source(group, [(4, 8), (8,)], [BF16, BF16])[0]


def test_gradient_sums_round_only_at_the_full_shape():
    """exp(b) spans the group when b is an expanded view and not when b is a bias: the same layout
    patterns, but only the first one's gradient is summed in fp16 per element (the bias's is a sum over
    rows, which eager rounds once), so the backward key tells them apart."""
    group = Group(["x", "b"], [Step("exp", (("input", 1),)), Step("mul", (("input", 0), ("step", 0))),
                               Step("add", (("step", 1), ("step", 0)))], [2])
    x, grads = meta(4, 8, dtype=F16), [meta(4, 8, dtype=F16)]
    bias, _ = plan_backward(group, [x, meta(8, dtype=F16)], grads, [True, True])
    expanded, _ = plan_backward(group, [x, meta(4, 8, dtype=F16, strides=(0, 1))], grads, [True, True])
    assert bias.spec.operands[:2] == expanded.spec.operands[:2] and bias.spec != expanded.spec
    assert ("step", 0) in expanded.spec.rounded_adjoints and ("step", 0) not in bias.spec.rounded_adjoints
    assert "a0 = a0 + round_fp16(" in source(group, [(4, 8), (8,)], [F16, F16])[1]
    assert "a0 = round_fp16(a0 + round_fp16(" in source(group, [(4, 8), (4, 8)], [F16, F16], [None, (0, 1)])[1]
