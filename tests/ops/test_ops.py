"""Tests for graphopt.ops: templates against torch, spellings, binding, twins, flops, unknown ops."""
import json
import math
import operator
import os
import re
import subprocess
import sys
from pathlib import Path

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis_profiles import examples
from torch._subclasses import FakeTensorMode
from torch.fx import Graph, GraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from graphopt.analysis import fake_kernels
import graphopt.ops as ops
from graphopt.ops import KINDS, PRECISION_CLASSES, Bound, OpInfo, bind, canonical_ops, flops, lookup, lookup_target
from graphopt.ops.registry import TARGETS, UNRESOLVED
from graphopt.ops.shim import evaluate
from graphopt.ops.spellings import SPELLINGS
from graphopt.ops.variants import BY_VALUE, VARIANT_OF
from op_cases import ATOL, CASE_IDS, CASES, GEN, randn

aten = torch.ops.aten
OPS = canonical_ops()
SEED = int(os.environ.get("GRAPHOPT_TEST_SEED", 0))


@pytest.fixture(autouse=True)
def seeded(request):
    """Each test draws the same inputs however the suite is filtered or ordered."""
    GEN.manual_seed(SEED + sum(map(ord, request.node.name)))


def as64(v):
    return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def reference(fn, operands, params):
    """torch's result at fp32, and at fp64 (the exact value, for ops torch computes with cancellation)."""
    return fn(*operands, **params), fn(*map(as64, operands), **params)


def assert_close(ours, refs, rtol, atol):
    """Within tolerance of any reference; NaN where torch gives NaN."""
    ours = torch.as_tensor(ours)
    for ref in refs:
        ref = torch.as_tensor(ref)
        ours_, ref = torch.broadcast_tensors(ours, ref)
        if ref.dtype == torch.bool or ours_.dtype == torch.bool:
            if torch.equal(ours_.bool(), ref.bool()):
                return
        elif torch.allclose(ours_.double(), ref.double(), rtol=rtol, atol=atol, equal_nan=True):
            return
    worst = (ours_.double() - ref.double()).abs().max()
    raise AssertionError(f"template disagrees with torch (max abs diff {worst}):\nours {ours}\ntorch {ref}")


def values(op, operands, params):
    return dict(zip(op.operands, operands), **params)


def test_every_template_has_a_case():
    templated = {n for n, o in OPS.items() if o.triton and not o.inplace_of and not o.out_variant_of}
    assert templated - {c[0] for c in CASES} == set()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_triton_template_matches_torch(case):
    name, fn, make, params = case
    op = OPS[name]
    operands = make()
    ours = evaluate(op.triton, **values(op, operands, params))
    if name == "to_dtype":
        ours = torch.as_tensor(ours).to(params["dtype"])
    assert_close(ours, reference(fn, operands, params), rtol=1e-5, atol=ATOL.get(name, 0))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_derivative_templates_match_autograd(case):
    name, fn, make, params = case
    op = OPS[name]
    operands = make()
    differentiable = [i for i, d in enumerate(op.derivatives) if d is not None
                      and isinstance(operands[i], torch.Tensor) and operands[i].is_floating_point()]
    if name == "to_dtype" or not differentiable:
        assert name == "to_dtype" or all(d is None for d in op.derivatives), f"{name}: untested derivatives"
        return
    # operands expanded to the output shape: autograd then gives each element's contribution, as the
    # templates do, without a broadcast reduction's rounding in the way (0-dim operands stay, and are summed)
    out = torch.as_tensor(evaluate(op.triton, **values(op, operands, params)))
    operands = [o.expand(out.shape).contiguous() if isinstance(o, torch.Tensor) and o.dim() else o for o in operands]
    leaves = [o.double().requires_grad_() if i in differentiable else as64(o) for i, o in enumerate(operands)]
    g = randn(*out.shape)
    grads = torch.autograd.grad(fn(*leaves, **params), [leaves[i] for i in differentiable], g.double(), allow_unused=True)
    for i, expected in zip(differentiable, grads):
        expected = torch.zeros_like(leaves[i]) if expected is None else expected
        contribution = evaluate(op.derivatives[i], g=g, out=out, **values(op, operands, params))
        ours = torch.broadcast_to(torch.as_tensor(contribution, dtype=torch.float32), out.shape).sum_to_size(operands[i].shape)
        # atol: where a derivative crosses zero (silu, mish, gelu near x = -1) its O(1) terms cancel in fp32
        assert_close(ours, [expected], rtol=1e-4, atol=ATOL.get(name, 1e-7))


HYPOTHESIS_OPS = ["exp", "expm1", "log1p", "tanh", "sigmoid", "erf", "gelu", "gelu_tanh", "silu", "mish", "softplus",
                  "elu", "sin", "cos", "abs", "neg", "square", "relu", "leaky_relu", "hardswish", "hardsigmoid", "round"]
REFERENCE = {name: fn for name, fn, _, _ in reversed(CASES)}


@settings(max_examples=examples(60), deadline=None)
@given(name=st.sampled_from(HYPOTHESIS_OPS),
       x=hnp.arrays("float32", st.integers(1, 16), elements=st.floats(-30, 30, width=32)))
def test_templates_on_hypothesis_inputs(name, x):
    """Default params, any float32 in [-30, 30]: overflow, underflow and exact integers included."""
    op, x = OPS[name], torch.from_numpy(x)
    params = dict(op.params)
    fn = lambda t: REFERENCE[name](t, **params)
    ours = evaluate(op.triton, x=x, **params)
    # atol: at |x| ~ 7 even fp64's 1 + tanh(u) cancels (gelu_tanh ~ 1e-15); ours is the accurate one there
    assert_close(ours, [fn(x), fn(x.double())], rtol=1e-5, atol=ATOL.get(name, 1e-10))


TL_FUNCTIONS = {"exp", "log", "sqrt", "rsqrt", "abs", "where", "maximum", "minimum", "sigmoid", "erf", "floor", "ceil",
                "sin", "cos"}


def test_templates_use_only_interpreter_safe_triton_and_known_names():
    import triton.language as tl
    for name, op in OPS.items():
        for i, template in enumerate((op.triton, *(op.derivatives or ()))):
            if template is None:
                continue
            used = set(re.findall(r"tl\.(\w+)", template))
            assert used <= TL_FUNCTIONS and all(hasattr(tl, f) for f in used), (name, used)
            placeholders = set(re.findall(r"{(\w+)}", template))
            allowed = set(op.operands) | dict(op.params).keys() | ({"g", "out"} if i else set())
            assert placeholders <= allowed, (name, placeholders - allowed)


INTERPRETER_SCRIPT = r'''
import importlib.util, json, sys
import torch
from graphopt.ops import canonical_ops
from graphopt.ops.shim import evaluate
from graphopt.ops.templates import render

KERNEL = """
@triton.jit
def k{index}({pointers}g_ptr, out_ptr, res_ptr):
    offs = tl.arange(0, 64)
{loads}    g = tl.load(g_ptr + offs)
    out = tl.load(out_ptr + offs)
    tl.store(res_ptr + offs, {expr})
"""
torch.manual_seed(0)
source, runs = ["import triton", "import triton.language as tl"], []
for name, op in canonical_ops().items():
    if not op.triton or op.inplace_of or op.out_variant_of:
        continue
    params = {p: 3.0 if v is None else v for p, v in op.params if p != "dtype"}
    for i, template in enumerate((op.triton, *op.derivatives)):
        if template is not None:
            expr = render(template, **{o: o for o in op.operands}, g="g", out="out", **params)
            loads = "".join(f"    {o} = tl.load({o}_ptr + offs)\n" for o in op.operands)
            pointers = "".join(f"{o}_ptr, " for o in op.operands)
            source.append(KERNEL.format(index=len(runs), pointers=pointers, loads=loads, expr=expr))
            runs.append((f"{name}[{i}]", op, template, params))
path = sys.argv[1] + "/kernels.py"
open(path, "w").write("\n".join(source))
spec = importlib.util.spec_from_file_location("kernels", path)
kernels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernels)
bad = []
for k, (label, op, template, params) in enumerate(runs):
    xs = [torch.randn(64) * 3 for _ in op.operands]
    g, out, res = torch.randn(64), torch.randn(64), torch.empty(64)
    getattr(kernels, f"k{k}")[(1,)](*xs, g, out, res)
    expected = torch.as_tensor(evaluate(template, g=g, out=out, **dict(zip(op.operands, xs)), **params)).float()
    if not torch.allclose(res, torch.broadcast_to(expected, (64,)), rtol=1e-5, atol=1e-6, equal_nan=True):
        bad.append(label)
print(json.dumps(bad))
'''


def test_templates_compile_and_agree_in_the_triton_interpreter(tmp_path):
    """Every template is valid Triton, and Triton computes what the torch shim computes."""
    pytest.importorskip("triton")
    (tmp_path / "run.py").write_text(INTERPRETER_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root), PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


# ---------------------------------------------------------------- registry shape

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


# ---------------------------------------------------------------- building nodes

def graph_with(op, target, args, kwargs=None):
    """A one-call graph over placeholders x, y, c (bool), i (int64), with values in meta; returns the call."""
    g, nodes = Graph(), {}
    for name, v in {"x": randn(2, 3), "y": randn(2, 3), "c": randn(2, 3) > 0, "i": torch.tensor([0, 1])}.items():
        nodes[name] = g.placeholder(name)
        nodes[name].meta["val"] = v
    sub = lambda a: nodes[a] if isinstance(a, str) and a in nodes else a
    fix = lambda a: type(a)(sub(i) for i in a) if isinstance(a, (tuple, list)) else sub(a)
    node = getattr(g, op)(target, tuple(fix(a) for a in args), {k: fix(v) for k, v in (kwargs or {}).items()})
    g.output(node)
    return node


def fn(target, *args, **kwargs):
    return graph_with("call_function", target, args, kwargs)


def method(name, *args, **kwargs):
    return graph_with("call_method", name, args, kwargs)


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


# ---------------------------------------------------------------- bind

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


# ---------------------------------------------------------------- in-place twins

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


# ---------------------------------------------------------------- flops

def exported(module, *args):
    return torch.export.export(module, args, strict=False).module()


def node_of(gm, target):
    return next(n for n in gm.graph.nodes if n.target == target)


def test_flops():
    gm = exported(nn.Linear(16, 32), randn(2, 8, 16))
    assert flops(node_of(gm, aten.linear.default)) == 2 * (2 * 8) * 32 * 16

    class Bmm(nn.Module):
        def forward(self, a, b):
            return torch.bmm(a, b).relu().view(-1)

    gm = exported(Bmm(), randn(4, 5, 6), randn(4, 6, 7))
    assert flops(node_of(gm, aten.bmm.default)) == 2 * 4 * 5 * 7 * 6
    assert flops(node_of(gm, aten.relu.default)) == 4 * 5 * 7
    assert flops(node_of(gm, aten.view.default)) == 0

    gm = exported(nn.Conv2d(4, 8, 3, groups=2), randn(2, 4, 10, 10))
    assert flops(node_of(gm, aten.conv2d.default)) == 2 * (2 * 8 * 8 * 8) * (4 // 2 * 3 * 3)

    class Attention(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    gm = exported(Attention(), randn(2, 4, 8, 16), randn(2, 4, 10, 16), randn(2, 4, 10, 16))
    B, H, Lq, Lk, D = 2, 4, 8, 10, 16
    assert flops(node_of(gm, aten.scaled_dot_product_attention.default)) == 4 * B * H * Lq * Lk * D + 5 * B * H * Lq * Lk

    class Pools(nn.Module):
        def forward(self, x):
            return F.max_pool2d(x, 3, 2, 1), F.avg_pool2d(x, 2), F.max_pool1d(x[0], 3)

    gm = exported(Pools(), randn(2, 4, 8, 8))
    pools = [n for n in gm.graph.nodes if "pool" in str(n.target)]
    # one FLOP per window element of each output: a 3x3 pool reads its input about nine times
    assert [flops(n) for n in pools] == [2 * 4 * 4 * 4 * 9, 2 * 4 * 4 * 4 * 4, 4 * 8 * 2 * 3]

    class Experts(nn.Module):  # a MoE layer's grouped matmuls: 32 rows in 3 groups (the second empty)
        def forward(self, x, w, g, offs):
            return torch._grouped_mm(x, w, offs=offs), torch._grouped_mm(x.t(), g, offs=offs)

    offs = torch.tensor([8, 8, 32], dtype=torch.int32)
    with fake_kernels.active():  # torch's own fake takes bfloat16 only
        gm = exported(Experts(), randn(32, 16), randn(3, 24, 16).transpose(-2, -1), randn(32, 24), offs)
    forward, weight_grad = [n for n in gm.graph.nodes if n.target == aten._grouped_mm.default]
    assert flops(forward) == 2 * 32 * 24 * 16       # each row times its group's 16 x 24 matrix
    assert flops(weight_grad) == 2 * 16 * 24 * 32   # each group's rows contracted once: 32 rows in all

    traced = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(16, 32), nn.ReLU()))
    assert all(flops(n, traced) == 0 for n in traced.graph.nodes)  # no meta: 0, no exception
    FakeTensorProp(traced, FakeTensorMode(allow_non_fake_inputs=True)).propagate(randn(3, 16))
    assert [flops(n, traced) for n in traced.graph.nodes if n.op == "call_module"] == [2 * 3 * 32 * 16, 3 * 32]


# ---------------------------------------------------------------- unknown ops

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
