"""graphopt.ops templates and their torch shim: each against torch and its derivatives against
autograd, and valid Triton in the interpreter."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from hypothesis_profiles import examples

from graphopt.ops import canonical_ops
from graphopt.ops.shim import evaluate
from op_cases import ATOL, CASES, CASE_IDS, randn, seeded  # seeded: an autouse fixture, seeds GEN per test

OPS = canonical_ops()


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
