"""graphopt.ops' registry: its public names, its tables consistent with each other, each op's precision
class and flags."""
import pytest

import graphopt.ops as ops
from graphopt.ops import KINDS, PRECISION_CLASSES, canonical_ops
from graphopt.ops.registry import TARGETS, UNRESOLVED
from graphopt.ops.spellings import SPELLINGS
from graphopt.ops.variants import VARIANT_OF

OPS = canonical_ops()


def test_public_names():
    assert KINDS == ("elementwise", "view", "reduction", "matmul", "normalization", "loss", "random", "creation",
                     "other")
    assert PRECISION_CLASSES == ("lower", "fp32", "promote")
    for name in ("OpInfo", "Bound", "lookup", "lookup_target", "bind", "flops", "canonical_ops"):
        assert hasattr(ops, name)


def test_table_consistency():
    assert UNRESOLVED == []  # every explicit spelling token names something in this torch
    assert set(SPELLINGS) <= set(OPS) and {s.name for s in TARGETS.values()} <= set(OPS)
    reachable = set(SPELLINGS) | set(VARIANT_OF)
    for name, op in OPS.items():
        assert op.name == name and op.kind in KINDS and op.precision in PRECISION_CLASSES + (None,)
        assert hash(op) is not None  # frozen and hashable: passes may key dicts and sets by OpInfo
        assert name in reachable or op.inplace_of or op.out_variant_of, f"{name} has no spelling"
        if op.inplace:
            twin = OPS[op.inplace]
            assert twin.mutates and twin.inplace_of == name and twin.kind == op.kind and twin.operands == op.operands
            assert twin.precision is None  # autocast never casts in-place ops
        if op.out_variant:
            assert OPS[op.out_variant].mutates and OPS[op.out_variant].out_variant_of == name


@pytest.mark.parametrize("name,precision", [
    ("linear", "lower"), ("matmul", "lower"), ("mm", "lower"), ("bmm", "lower"), ("addmm", "lower"),
    ("baddbmm", "lower"), ("conv2d", "lower"), ("conv1d", "lower"), ("scaled_dot_product_attention", "lower"),
    ("softmax", "fp32"), ("log_softmax", "fp32"), ("layer_norm", "fp32"), ("group_norm", "fp32"), ("norm", "fp32"),
    ("exp", "fp32"), ("log", "fp32"), ("pow", "fp32"), ("pow_scalar", "fp32"), ("sum", "fp32"), ("cumsum", "fp32"),
    ("mse_loss", "fp32"), ("cross_entropy", "fp32"), ("nll_loss", "fp32"), ("rsqrt", "fp32"), ("rms_norm", "fp32"),
    ("cat", "promote"), ("stack", "promote"), ("index_put", "promote"), ("addcmul", "promote"),
    ("relu", None), ("add", None), ("gelu", None), ("embedding", None), ("mean", None), ("batch_norm", None),
    ("exp_", None), ("add_out", None),
])
def test_precision_follows_autocast(name, precision):
    assert OPS[name].precision == precision


def test_flags():
    assert OPS["dropout"].random and OPS["dropout"].kind == "random" and OPS["dropout_"].random
    assert OPS["scaled_dot_product_attention_dropout"].random and not OPS["scaled_dot_product_attention"].random
    assert OPS["rand_like"].random and not OPS["zeros_like"].random
    assert OPS["assert_tensor_metadata"].side_effect and OPS["assert_tensor_metadata"].kind == "other"
    assert OPS["copy_"].mutates and OPS["index_put_"].mutates and OPS["add_"].mutates and OPS["batch_norm_train"].mutates
    assert OPS["setitem"].mutates and OPS["add_out"].mutates and OPS["add_out"].out_variant_of == "add"
    assert not OPS["copy"].mutates and not OPS["batch_norm"].mutates
    assert OPS["view"].aliases and OPS["transpose"].aliases and not OPS["clone"].aliases
    assert OPS["split"].output == "tuple" and OPS["max_dim"].output == "tuple" and OPS["size"].output == "scalar"
    assert OPS["embedding"].kind == "other" and OPS["softmax"].kind == "normalization"
    assert OPS["leaky_relu"].params == (("negative_slope", 0.01),)
    assert OPS["where"].derivatives[0] is None and OPS["eq"].derivatives == (None, None)
