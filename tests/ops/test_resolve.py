"""graphopt.ops.lookup: every spelling of an op to its canonical op, from symbolic trace and export;
unknown ops stay opaque."""
import math
import operator

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Graph, GraphModule

from graphopt.ops import Bound, OpInfo, bind, canonical_ops, flops, lookup, lookup_target
from one_call_graphs import fn, graph_with, method
from op_cases import randn, seeded  # seeded: an autouse fixture, seeds GEN per test

aten = torch.ops.aten
OPS = canonical_ops()


SPELLED = [  # (node builder, canonical op)
    (lambda: fn(torch.relu, "x"), "relu"), (lambda: fn(F.relu, "x"), "relu"), (lambda: method("relu", "x"), "relu"),
    (lambda: fn(aten.relu.default, "x"), "relu"), (lambda: fn(aten.relu, "x"), "relu"),
    (lambda: fn(operator.add, "x", "y"), "add"), (lambda: fn(torch.add, "x", "y"), "add"),
    (lambda: method("add", "x", "y"), "add"), (lambda: method("__add__", "x", 1), "add"),
    (lambda: method("__radd__", "x", 1), "add"), (lambda: fn(aten.add.Tensor, "x", "y"), "add"),
    (lambda: fn(aten.add.Scalar, "x", 2), "add"), (lambda: fn(operator.iadd, "x", "y"), "add_"),
    (lambda: method("add_", "x", "y"), "add_"), (lambda: fn(aten.add_.Tensor, "x", "y"), "add_"),
    (lambda: fn(aten.add.out, "x", "y", out="y"), "add_out"), (lambda: fn(torch.add, "x", "y", out="y"), "add_out"),
    (lambda: fn(operator.sub, "x", "y"), "sub"), (lambda: method("__rsub__", "x", 2), "sub"),
    (lambda: fn(aten.rsub.Scalar, "x", 2), "sub"), (lambda: fn(operator.mul, "x", 2), "mul"),
    (lambda: fn(aten.mul.Tensor, "x", "y"), "mul"), (lambda: fn(operator.truediv, "x", "y"), "div"),
    (lambda: method("__rtruediv__", "x", 1), "div"), (lambda: fn(torch.div, "x", "y", rounding_mode="floor"), "div_floor"),
    (lambda: fn(aten.div.Tensor_mode, "x", "y", rounding_mode="trunc"), "div_trunc"),
    (lambda: fn(operator.floordiv, "x", "y"), "div_floor"), (lambda: fn(operator.mod, "x", 3), "remainder"),
    (lambda: fn(operator.neg, "x"), "neg"), (lambda: method("__neg__", "x"), "neg"),
    (lambda: fn(operator.pow, "x", 2), "pow_scalar"), (lambda: fn(operator.pow, "x", "y"), "pow"),
    (lambda: fn(operator.pow, 2, "x"), "pow"), (lambda: fn(aten.pow.Tensor_Scalar, "x", 2), "pow_scalar"),
    (lambda: fn(aten.pow.Tensor_Tensor, "x", "y"), "pow"), (lambda: method("__rpow__", "x", 2), "pow"),
    (lambda: fn(torch.square, "x"), "square"), (lambda: fn(F.gelu, "x"), "gelu"),
    (lambda: fn(F.gelu, "x", approximate="tanh"), "gelu_tanh"), (lambda: fn(aten.gelu.default, "x", approximate="tanh"), "gelu_tanh"),
    (lambda: fn(aten.gelu_.default, "x", approximate="tanh"), "gelu_tanh_"), (lambda: fn(F.silu, "x"), "silu"),
    (lambda: fn(F.relu, "x", inplace=True), "relu_"), (lambda: fn(F.leaky_relu, "x", 0.2, True), "leaky_relu_"),
    (lambda: fn(torch.clamp, "x", min=0), "clamp_min"), (lambda: method("clamp", "x", None, 1), "clamp_max"),
    (lambda: fn(torch.clip, "x", -1, 1), "clamp"), (lambda: fn(aten.clamp.Tensor, "x", "y", "y"), "clamp"),
    (lambda: fn(torch.max, "x"), "max"), (lambda: fn(torch.max, "x", 1), "max_dim"), (lambda: fn(torch.max, "x", "y"), "maximum"),
    (lambda: method("max", "x", dim=0), "max_dim"), (lambda: fn(aten.max.other, "x", "y"), "maximum"),
    (lambda: fn(torch.where, "c", "x", 0.0), "where"), (lambda: fn(torch.where, "c"), None),
    (lambda: method("masked_fill", "x", "c", 0.0), "masked_fill"), (lambda: fn(operator.eq, "x", "y"), "eq"),
    (lambda: method("__lt__", "x", 0), "lt"), (lambda: fn(aten.ne.Scalar, "x", 0), "ne"),
    (lambda: fn(operator.and_, "c", "c"), "bitwise_and"), (lambda: fn(operator.invert, "c"), "bitwise_not"),
    (lambda: fn(torch.logical_not, "c"), "logical_not"), (lambda: method("float", "x"), "to_dtype"),
    (lambda: method("to", "x", torch.float16), "to_dtype"), (lambda: method("to", "x", "cpu", torch.float16), "to_dtype"),
    (lambda: method("to", "x", "meta"), "to_device"), (lambda: method("type_as", "x", "i"), "to_dtype"),
    (lambda: fn(aten._to_copy.default, "x", dtype=torch.float16), "to_dtype"),
    (lambda: fn(aten.to.dtype_layout, "x", dtype=torch.float16, layout=torch.strided, device=torch.device("cpu")), "to_dtype"),
    (lambda: fn(torch.round, "x", decimals=2), None), (lambda: fn(torch.round, "x"), "round"),
    (lambda: fn(F.dropout, "x", 0.2), "dropout"), (lambda: fn(aten.native_dropout.default, "x", 0.2, True), "native_dropout"),
    (lambda: fn(F.dropout, "x", 0.2, True, True), "dropout_"),
    (lambda: method("view", "x", 3, 2), "view"), (lambda: method("view", "x", torch.int32), None),
    (lambda: fn(torch.reshape, "x", (3, 2)), "reshape"), (lambda: fn(torch.flatten, "x"), "flatten"),
    (lambda: method("transpose", "x", 0, 1), "transpose"), (lambda: fn(torch.swapaxes, "x", 0, 1), "transpose"),
    (lambda: method("t", "x"), "t"), (lambda: fn(aten.slice.Tensor, "x", 0, 0, 1), "slice"),
    (lambda: fn(operator.getitem, "x", 0), "getitem"), (lambda: fn(operator.getitem, "x", (slice(None), None)), "getitem"),
    (lambda: fn(operator.getitem, "x", "i"), "getitem_index"), (lambda: fn(aten.index.Tensor, "x", ["i"]), "index"),
    (lambda: method("contiguous", "x"), "contiguous"), (lambda: method("detach", "x"), "detach"),
    (lambda: method("split", "x", 1, 1), "split"), (lambda: fn(torch.chunk, "x", 2), "chunk"),
    (lambda: fn(torch.sum, "x"), "sum"), (lambda: method("mean", "x", -1, keepdim=True), "mean"),
    (lambda: fn(torch.var, "x", 0), "var"), (lambda: fn(torch.softmax, "x", -1), "softmax"),
    (lambda: fn(F.softmax, "x", -1), "softmax"), (lambda: fn(aten._softmax.default, "x", -1, False), "softmax"),
    (lambda: fn(F.log_softmax, "x", dim=-1), "log_softmax"), (lambda: fn(torch.cumsum, "x", 0), "cumsum"),
    (lambda: fn(torch.argmax, "x"), "argmax"), (lambda: fn(torch.logsumexp, "x", 0), "logsumexp"),
    (lambda: fn(torch.norm, "x"), "norm"), (lambda: fn(torch.linalg.vector_norm, "x"), "norm"),
    (lambda: fn(F.layer_norm, "x", (3,)), "layer_norm"), (lambda: fn(aten.native_layer_norm.default, "x", [3], None, None, 1e-5), "native_layer_norm"),
    (lambda: fn(F.linear, "x", "y"), "linear"), (lambda: fn(torch.matmul, "x", "y"), "matmul"),
    (lambda: fn(operator.matmul, "x", "y"), "matmul"), (lambda: fn(aten.mm.default, "x", "y"), "mm"),
    (lambda: fn(F.scaled_dot_product_attention, "x", "x", "x"), "scaled_dot_product_attention"),
    (lambda: fn(F.scaled_dot_product_attention, "x", "x", "x", dropout_p=0.1), "scaled_dot_product_attention_dropout"),
    (lambda: fn(F.embedding, "i", "x"), "embedding"), (lambda: fn(torch.cat, ["x", "y"], 1), "cat"),
    (lambda: fn(torch.stack, ["x", "y"]), "stack"), (lambda: fn(torch.zeros, 2, 3), "zeros"),
    (lambda: fn(torch.arange, 5), "arange"), (lambda: method("new_ones", "x", (2,)), "new_ones"),
    (lambda: fn(torch.zeros_like, "x"), "zeros_like"), (lambda: fn(torch.rand_like, "x"), "rand_like"),
    (lambda: fn(torch.tensor, 1.0), "tensor"), (lambda: fn(aten.scalar_tensor.default, 1.0), "scalar_tensor"),
    (lambda: fn(torch.triu, "x"), "triu"), (lambda: fn(torch.gather, "x", 0, "i"), "gather"),
    (lambda: fn(F.cross_entropy, "x", "i"), "cross_entropy"), (lambda: fn(F.mse_loss, "x", "y"), "mse_loss"),
    (lambda: method("copy_", "x", "y"), "copy_"), (lambda: method("index_put_", "x", ["i"], "y"), "index_put_"),
    (lambda: fn(aten._assert_tensor_metadata.default, "x", dtype=torch.float32), "assert_tensor_metadata"),
    (lambda: method("size", "x", 0), "size"), (lambda: fn(aten.sym_size.int, "x", 0), "size"),
    (lambda: fn(operator.setitem, "x", "c", 0.0), "setitem"),
]


@pytest.mark.parametrize("build,expected", SPELLED, ids=[f"{i}-{e}" for i, (_, e) in enumerate(SPELLED)])
def test_lookup_every_spelling(build, expected):
    op = lookup(build())
    assert (op.name if op else None) == expected


@pytest.mark.parametrize("target,expected", [
    (torch.relu, "relu"), (F.relu, "relu"), ("relu", "relu"), (nn.ReLU, "relu"), (aten.relu.default, "relu"),
    (operator.add, "add"), ("__radd__", "add"), (aten.add.Scalar, "add"), (aten.pow.Tensor_Scalar, "pow_scalar"),
    (aten.max.other, "maximum"), (aten.max.dim, "max_dim"), (aten.max.default, "max"), (nn.GELU, "gelu"),
    (nn.Linear, "linear"), (nn.RMSNorm, "rms_norm"), (nn.BatchNorm2d, "batch_norm"), (aten.add.out, "add_out"),
    (aten._native_batch_norm_legit_no_training.default, "native_batch_norm"), ("float", "to_dtype"),
    (math.sqrt, None), (print, None), ("no_such_method", None), ([1, 2], None),
])
def test_lookup_target(target, expected):
    op = lookup_target(target)
    assert (op.name if op else None) == expected


def test_python_arithmetic_on_non_tensors_is_not_an_op():
    g = Graph()
    x = g.placeholder("x")
    size = g.call_method("size", (x, 0))
    plus = g.call_function(operator.add, (size, 1))
    shape = g.call_function(getattr, (x, "shape"))
    first = g.call_function(operator.getitem, (shape, 0))
    consts = g.call_function(operator.mul, (3, 4))
    assert lookup(size).name == "size"
    assert lookup(plus) is None and lookup(first) is None and lookup(consts) is None
    sym = fn(operator.add, "x", 1)
    sym.meta["val"] = 5  # exported SymInt arithmetic carries a non-tensor val
    assert lookup(sym) is None


def trace(module):
    gm = torch.fx.symbolic_trace(module)
    return gm, {n.target: n for n in gm.graph.nodes if n.op == "call_module"}


def test_lookup_modules_from_symbolic_trace():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LeakyReLU(0.1), nn.GELU("tanh"), nn.Hardtanh(-2, 3), nn.ReLU6(),
                          nn.ELU(), nn.SiLU(), nn.Mish(), nn.Softplus(), nn.Sigmoid(), nn.Tanh(), nn.Hardswish(),
                          nn.Hardsigmoid(), nn.Dropout(0.2), nn.LayerNorm(8), nn.RMSNorm(8), nn.Softmax(-1),
                          nn.LogSoftmax(-1), nn.Identity(), nn.ReLU(inplace=True))
    gm, mods = trace(model)
    names = [lookup(n, gm).name for n in gm.graph.nodes if n.op == "call_module"]
    assert names == ["linear", "relu", "leaky_relu", "gelu_tanh", "hardtanh", "relu6", "elu", "silu", "mish", "softplus",
                     "sigmoid", "tanh", "hardswish", "hardsigmoid", "dropout", "layer_norm", "rms_norm", "softmax",
                     "log_softmax", "alias", "relu_"]
    gm, mods = trace(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.GroupNorm(2, 4), nn.MaxPool2d(2),
                                   nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Embedding(3, 2)))
    assert [lookup(n).name for n in mods.values()] == ["conv2d", "batch_norm_train", "group_norm", "max_pool2d",
                                                       "avg_pool2d", "adaptive_avg_pool2d", "flatten", "embedding"]
    gm.eval()
    assert lookup(mods["1"]).name == "batch_norm"


def test_lookup_aten_overloads_from_export():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x, y):
            a = torch.relu(x) + y * 2 - x / y
            b = F.gelu(a, approximate="tanh") ** 2 + torch.where(a > 0, a, -a).clamp(min=0)
            c = F.softmax(self.lin(b), -1).sum(-1, keepdim=True)
            return F.layer_norm(b * c, (6,)).float().transpose(0, 1)

    gm = torch.export.export(M(), (randn(3, 6), randn(3, 6) + 5), strict=False).module()
    found = {str(n.target): lookup(n).name for n in gm.graph.nodes if n.op == "call_function"}
    expected = {"aten.relu.default": "relu", "aten.add.Tensor": "add", "aten.mul.Tensor": "mul", "aten.sub.Tensor": "sub",
                "aten.div.Tensor": "div", "aten.gelu.default": "gelu_tanh", "aten.pow.Tensor_Scalar": "pow_scalar",
                "aten.where.self": "where", "aten.gt.Scalar": "gt", "aten.neg.default": "neg",
                "aten.clamp.default": "clamp_min", "aten.linear.default": "linear", "aten.softmax.int": "softmax",
                "aten.sum.dim_IntList": "sum", "aten.layer_norm.default": "layer_norm", "aten.transpose.int": "transpose"}
    assert {k: v for k, v in found.items() if k in expected} == expected


def test_lookup_answers_again_only_while_what_it_read_is_the_same():
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    both = g.call_function(operator.and_, (x, y))
    for n in (x, y, both):
        n.meta["val"] = torch.ones(2, dtype=torch.int32)
    assert lookup(both).name == lookup(both).name == "bitwise_and"
    for n in (x, y, both):  # annotated again: on bools & is logical
        n.meta["val"] = torch.ones(2, dtype=torch.bool)
    assert lookup(both).name == "logical_and"
    both.args = (x, 2.0)  # new arguments
    assert bind(both).params == {} and bind(both).operands == (x, 2.0)
    both.target = operator.mul  # a new target
    assert lookup(both).name == "mul"
    del y.meta["val"]  # an input without metadata: its kind is resolved in turn, never answered from before
    both.args = (x, y)
    assert lookup(both).name == "mul"


@torch.fx.wrap
def user_function(x):
    return x * 2


class Leaf(nn.Module):
    def forward(self, x):
        return x + 1


class PatchedReLU(nn.ReLU):
    def forward(self, x):
        return x.sigmoid()


def test_unknown_ops_are_opaque():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.leaf, self.patched = Leaf(), PatchedReLU()

        def forward(self, x):
            return self.patched(self.leaf(user_function(x)))

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, (Leaf, PatchedReLU)) or super().is_leaf_module(m, name)

    m = M()
    gm = GraphModule(m, Tracer().trace(m))
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module")]
    assert len(calls) == 3
    for n in calls:
        assert lookup(n, gm) is None and bind(n, gm) is None and flops(n, gm) == 0
    assert lookup(graph_with("call_module", "missing", ("x",))) is None
    assert lookup(method("no_such_method", "x")) is None
    assert lookup(fn(len, "x")) is None
    assert isinstance(OPS["relu"], OpInfo) and isinstance(bind(fn(torch.relu, "x")), Bound)
