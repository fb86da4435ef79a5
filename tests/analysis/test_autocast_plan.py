"""graphopt.analysis.autocast_plan: each op's autocast class on the device the graph runs on."""
from graphopt.analysis.autocast_plan import device_class


def test_autocast_lists_follow_the_device():
    # the registry's classes are CUDA's; CPU autocast leaves softmax and layer_norm alone,
    # and matmul-like composites reach mm/bmm, which it lowers
    assert [device_class(op, "cuda") for op in ("softmax", "layer_norm", "linear", "cross_entropy")] == \
        ["fp32", "fp32", "lower", "fp32"]
    assert [device_class(op, "cpu") for op in ("softmax", "layer_norm", "linear", "cross_entropy", "einsum", "pow_scalar")] == \
        [None, None, "lower", "fp32", "lower", None]
