"""graphopt.codegen.layout: dims merged, size-one dims dropped, broadcasts marked."""
from graphopt.codegen.layout import collapse, expanded_strides


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
