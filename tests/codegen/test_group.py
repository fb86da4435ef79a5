"""graphopt.codegen's group IR: its checks, each step's dtype as eager torch promotes it, and what is
declined and why."""
import re

import pytest
import torch

from graphopt.codegen import Group, Step, Unsupported, step_dtypes, supports
from codegen_groups import BF16, F16, meta


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
