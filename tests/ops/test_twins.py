"""graphopt.ops' in-place twins: each computes what its out-of-place op computes."""
import pytest
import torch

from graphopt.ops import canonical_ops, lookup_target
from graphopt.ops.variants import BY_VALUE, VARIANT_OF
from op_cases import CASES, seeded  # seeded: an autouse fixture, seeds GEN per test

aten = torch.ops.aten
OPS = canonical_ops()


TWIN_CASES = [c for c in CASES if OPS[c[0]].inplace and isinstance(c[2]()[0], torch.Tensor)]


@pytest.mark.parametrize("case", TWIN_CASES, ids=[c[0] for c in TWIN_CASES])
def test_inplace_twin_computes_the_same(case):
    name, fn_, make, params = case
    op, operands = OPS[name], make()
    twin = OPS[op.inplace]
    assert twin.mutates and twin.inplace_of == name
    expected = fn_(*operands, **params)
    # aten's in-place packet of the op, or of its base with the argument that selects the variant
    base = name if hasattr(aten, name + "_") else VARIANT_OF[name]
    selector = {arg: value for b, (arg, _, choices) in BY_VALUE.items() for value, n in choices.items() if n == name}
    target = operands[0].expand(expected.shape).clone()
    result = getattr(aten, base + "_")(target, *operands[1:], **params, **selector)
    assert result is target
    torch.testing.assert_close(target, expected.to(target.dtype), equal_nan=True)


def test_inplace_twins_of_other_kinds():
    for name in ("index_put", "scatter_add", "copy", "fill", "dropout", "transpose", "masked_fill"):
        twin = OPS[OPS[name].inplace]
        assert twin.mutates and twin.kind == OPS[name].kind and lookup_target(getattr(aten, twin.name)) is twin
