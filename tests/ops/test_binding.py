"""graphopt.ops.bind: a call's arguments bound to its op's parameters, as torch reads them."""
import operator

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt.ops import bind, lookup
from graphopt.ops.shim import evaluate
from one_call_graphs import fn, method
from op_cases import seeded  # seeded: an autouse fixture, seeds GEN per test

aten = torch.ops.aten


def rendered_value(b):
    """Evaluate a bound elementwise node through its template, with the placeholders' values."""
    vals = {n: (v.meta["val"] if isinstance(v, torch.fx.Node) else v) for n, v in zip(b.op.operands, b.operands)}
    return evaluate(b.op.triton, **vals, **b.params)


def test_bind_positional_keyword_defaults():
    for node, slope in [(fn(F.leaky_relu, "x", 0.2), 0.2), (fn(F.leaky_relu, "x", negative_slope=0.3), 0.3),
                        (fn(F.leaky_relu, "x"), 0.01), (fn(aten.leaky_relu.default, "x", 0.4), 0.4)]:
        b = bind(node)
        assert b.op.name == "leaky_relu" and b.params == {"negative_slope": slope} and b.operands[0].name == "x"
    b = bind(fn(torch.add, "x", "y", alpha=3))
    assert b.params == {"alpha": 3} and [o.name for o in b.operands] == ["x", "y"]
    b = bind(method("sub", "x", 2, alpha=2))
    assert b.operands[1] == 2 and b.params == {"alpha": 2} and b["y"] == 2
    b = bind(fn(aten.elu.default, "x", 1.5))
    assert b.params == {"alpha": 1.5, "scale": 1, "input_scale": 1}
    b = bind(fn(F.hardtanh, "x", max_val=2.0))
    assert b.params == {"min_val": -1.0, "max_val": 2.0}
    b = bind(fn(F.softplus, "x", 2))
    assert b.params == {"beta": 2, "threshold": 20}


def test_bind_reversed_dunders_and_alpha():
    for node, expect in [(method("__rsub__", "x", 2), lambda x, y: 2 - x), (method("__rtruediv__", "x", 3), lambda x, y: 3 / x),
                         (method("__radd__", "x", 1), lambda x, y: 1 + x), (method("__rpow__", "x", 2), lambda x, y: 2 ** x),
                         (fn(aten.rsub.Scalar, "x", 5, 2), lambda x, y: 5 - 2 * x),
                         (fn(torch.rsub, "x", "y", alpha=3), lambda x, y: y - 3 * x),
                         (fn(torch.sub, "x", "y", alpha=0.5), lambda x, y: x - 0.5 * y),
                         (fn(operator.sub, 1.5, "x"), lambda x, y: 1.5 - x)]:
        b = bind(node)
        graph_vals = {n.name: n.meta["val"] for n in node.graph.nodes if n.op == "placeholder"}
        torch.testing.assert_close(torch.as_tensor(rendered_value(b)), expect(graph_vals["x"], graph_vals["y"]))
    b = bind(method("__rsub__", "x", 2))
    assert b.op.name == "sub" and b.operands[0] == 2 and b.operands[1].name == "x" and b.params == {"alpha": 1}


def test_bind_module_attributes():
    model = nn.Sequential(nn.LeakyReLU(0.1), nn.GELU("tanh"), nn.Hardtanh(-2.0, 3.0), nn.ELU(0.5), nn.Softplus(2, 10),
                          nn.Dropout(0.3), nn.Linear(4, 4, bias=False), nn.LayerNorm(4), nn.Softmax(1), nn.Flatten(0))
    gm = torch.fx.symbolic_trace(model)
    b = [bind(n, gm) for n in gm.graph.nodes if n.op == "call_module"]
    assert b[0].params == {"negative_slope": 0.1}
    assert b[1].op.name == "gelu_tanh" and b[1].params == {}
    assert b[2].params == {"min_val": -2.0, "max_val": 3.0}
    assert b[3].params == {"alpha": 0.5, "scale": 1.0, "input_scale": 1.0}
    assert b[4].params == {"beta": 2, "threshold": 10}
    assert b[5].params == {"p": 0.3, "train": True}
    assert b[6]["weight"] is model[6].weight and b[6]["bias"] is None and b[6]["x"].op == "call_module"
    assert b[7]["normalized_shape"] == (4,) and b[7]["eps"] == 1e-5 and b[7]["weight"] is model[7].weight
    assert b[8].params["dim"] == 1 and b[9].params == {"start_dim": 0, "end_dim": -1}
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Conv2d(1, 1, 1, padding_mode="reflect")))
    conv = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert lookup(conv).name == "conv2d" and bind(conv) is None  # padding_mode has no canonical form


def test_bind_variants_and_unsupported():
    assert bind(fn(torch.clamp, "x", min=0)).operands[1] == 0
    b = bind(method("clamp", "x", max="y"))
    assert b.op.name == "clamp_max" and [o.name for o in b.operands] == ["x", "y"]
    assert bind(fn(operator.pow, "x", 3)).params == {"exponent": 3}
    assert bind(method("float", "x")).params == {"dtype": torch.float32}
    assert bind(method("to", "x", torch.float16)).params == {"dtype": torch.float16}
    assert bind(method("type_as", "x", "i")).params == {"dtype": torch.int64}
    assert bind(fn(torch.max, "x", 1, True)).params == {"dim": 1, "keepdim": True}
    assert bind(method("view", "x", 3, 2)).params == {"size": (3, 2)}
    assert bind(method("permute", "x", 1, 0)).params == {"dims": (1, 0)}
    assert bind(fn(F.dropout, "x", 0.2, False)).params == {"p": 0.2, "train": False}
    b = bind(fn(torch.where, "c", "x", 0.0))
    assert b.operands[0].name == "c" and b.operands[2] == 0.0
    assert bind(fn(torch.cat, ["x", "y"], 1))["tensors"][1].name == "y"
    assert bind(fn(F.scaled_dot_product_attention, "x", "y", "y", is_causal=True)).params["is_causal"] is True
    # calls bind cannot express: out=, unsupported values, a spelling param with no canonical form
    assert bind(fn(torch.add, "x", "y", out="y")) is None and lookup(fn(torch.add, "x", "y", out="y")).mutates
    assert bind(fn(torch.round, "x", decimals=2)) is None
    assert bind(fn(F.embedding, "i", "x", max_norm=1.0)) is None
    assert bind(fn(F.gelu, "x", approximate="bogus")) is None and lookup(fn(F.gelu, "x", approximate="bogus")) is None
