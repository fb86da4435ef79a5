"""The generated kernel source (graphopt.codegen's programs): its checklist, what the backward
recomputes, where it rounds."""
import re

import torch

from graphopt.codegen import Group, Step
from graphopt.codegen.spec import plan_backward
from graphopt.runtime import source
from codegen_groups import BF16, F16, F32, chain, meta

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
