"""graphopt.codegen.spec: kernel keys that are structural, not sized, and record which gradients flow."""
import torch

from graphopt.codegen import Group, Step
from graphopt.codegen.spec import plan_backward, plan_forward
from codegen_groups import F16, chain, meta


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
