"""The elementwise op cases that tests/ops/test_templates.py (the registry's templates) and
tests/runtime/test_fused_runtime.py (the generated kernels) both check against eager torch: per op,
inputs that reach its hard regions (kinks, ties, cancellation, broadcasting, scalars)."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

aten = torch.ops.aten
GEN = torch.Generator()
SEED = int(os.environ.get("GRAPHOPT_TEST_SEED", 0))


@pytest.fixture(autouse=True)
def seeded(request):
    """Each test draws the same inputs however the suite is filtered or ordered; a module imports it to use it."""
    GEN.manual_seed(SEED + sum(map(ord, request.node.name)))


def randn(*shape, scale=1.0):
    return torch.randn(shape, generator=GEN) * scale


def rand(*shape, lo=0.0, hi=1.0):
    return torch.rand(*shape, generator=GEN) * (hi - lo) + lo


def away_from_zero(*shape):
    return torch.where(randn(*shape) < 0, -1.0, 1.0) * rand(*shape, lo=0.2, hi=3.0)


def wide(*shape):
    """Magnitudes from 1e-6 to ~3: exercises the cancellation-prone region near 0."""
    return randn(*shape) * 10 ** rand(*shape, lo=-6, hi=0.5)


def ints(*shape, lo=-3, hi=4):
    return torch.randint(lo, hi, shape, generator=GEN).float()


def halves(*shape):
    """Exact .5 ties (round-half-even), integers and plain values."""
    return torch.cat([ints(*shape[:-1], shape[-1] // 2, lo=-10, hi=10) / 2, randn(*shape[:-1], shape[-1] - shape[-1] // 2, scale=4)], -1)


def with_values(t, *values):
    """t with some entries set exactly to `values`: the kinks of piecewise ops, where gradients choose a side."""
    t = t.clone()
    for i, v in enumerate(values):
        t.view(-1)[i::5 * len(values)] = v
    return t


def with_zeros(t):
    return with_values(t, 0.0)


X, Y = (4, 1, 6), (1, 5, 6)  # broadcasting shapes


def UNARY():
    return (with_zeros(randn(*X, scale=3)),)


def BINARY():
    return randn(*X, scale=2), randn(*Y, scale=2)


# (op, reference torch function, operand generator, params)
CASES = [
    ("add", lambda x, y, alpha: torch.add(x, y, alpha=alpha), BINARY, {"alpha": 0.5}),
    ("sub", lambda x, y, alpha: torch.sub(x, y, alpha=alpha), BINARY, {"alpha": -2}),
    ("mul", torch.mul, BINARY, {}),
    ("div", torch.div, lambda: (randn(*X), away_from_zero(*Y)), {}),
    ("div_trunc", lambda x, y: torch.div(x, y, rounding_mode="trunc"), lambda: (randn(*X, scale=5), away_from_zero(*Y)), {}),
    ("div_floor", lambda x, y: torch.div(x, y, rounding_mode="floor"), lambda: (randn(*X, scale=5), away_from_zero(*Y)), {}),
    ("remainder", torch.remainder, lambda: (randn(*X, scale=5), away_from_zero(*Y)), {}),
    ("fmod", torch.fmod, lambda: (randn(*X, scale=5), away_from_zero(*Y)), {}),
    ("pow", torch.pow, lambda: (rand(*X, lo=0.1, hi=3), randn(*Y, scale=2)), {}),
    ("pow", torch.pow, lambda: (randn(4, 6, scale=2), ints(4, 6)), {}),  # negative bases, integer exponents
    ("pow", torch.pow, lambda: (2.5, randn(*X)), {}),  # scalar base (2 ** x)
    *[("pow_scalar", torch.pow, lambda: (randn(*X, scale=2),), {"exponent": e}) for e in (2, 3, -1, 0, -2.0)],
    *[("pow_scalar", torch.pow, lambda: (rand(*X, lo=0.05, hi=4),), {"exponent": e}) for e in (0.5, -1.5, 2.7)],
    ("addcmul", lambda x, y, z, value: torch.addcmul(x, y, z, value=value), lambda: (randn(*X), randn(*Y), randn(6)), {"value": 0.3}),
    ("addcdiv", lambda x, y, z, value: torch.addcdiv(x, y, z, value=value), lambda: (randn(*X), randn(*Y), away_from_zero(6)), {"value": 2}),
    ("neg", torch.neg, UNARY, {}),
    ("abs", torch.abs, UNARY, {}),
    ("sign", torch.sign, UNARY, {}),
    ("reciprocal", torch.reciprocal, lambda: (away_from_zero(*X),), {}),
    ("square", torch.square, UNARY, {}),
    ("sqrt", torch.sqrt, lambda: (rand(*X, lo=0.01, hi=9),), {}),
    ("rsqrt", torch.rsqrt, lambda: (rand(*X, lo=0.01, hi=9),), {}),
    ("exp", torch.exp, lambda: (randn(*X, scale=3),), {}),
    ("expm1", torch.expm1, lambda: (wide(*X),), {}),
    ("expm1", torch.expm1, lambda: (randn(*X, scale=4),), {}),
    ("log", torch.log, lambda: (rand(*X, lo=0.01, hi=20),), {}),
    ("log1p", torch.log1p, lambda: (wide(*X),), {}),
    ("log1p", torch.log1p, lambda: (rand(*X, lo=-0.95, hi=20),), {}),
    ("log2", torch.log2, lambda: (rand(*X, lo=0.01, hi=20),), {}),
    ("log10", torch.log10, lambda: (rand(*X, lo=0.01, hi=20),), {}),
    ("sin", torch.sin, UNARY, {}),
    ("cos", torch.cos, UNARY, {}),
    ("tanh", torch.tanh, lambda: (wide(*X),), {}),
    ("tanh", torch.tanh, lambda: (randn(*X, scale=5),), {}),
    ("sigmoid", torch.sigmoid, lambda: (randn(*X, scale=5),), {}),
    ("erf", torch.erf, UNARY, {}),
    ("floor", torch.floor, lambda: (halves(*X),), {}),
    ("ceil", torch.ceil, lambda: (halves(*X),), {}),
    ("trunc", torch.trunc, lambda: (halves(*X),), {}),
    ("round", torch.round, lambda: (halves(*X),), {}),
    ("relu", torch.relu, UNARY, {}),
    ("relu6", F.relu6, lambda: (with_values(randn(*X, scale=5), 0.0, 6.0),), {}),
    ("hardtanh", F.hardtanh, lambda: (with_values(randn(*X, scale=2), -0.5, 0.75),), {"min_val": -0.5, "max_val": 0.75}),
    ("leaky_relu", F.leaky_relu, UNARY, {"negative_slope": 0.2}),
    ("elu", lambda x, alpha, scale, input_scale: aten.elu(x, alpha, scale, input_scale), lambda: (with_zeros(wide(*X) * 3),),
     {"alpha": 1.3, "scale": 1.1, "input_scale": 0.7}),
    ("gelu", F.gelu, lambda: (randn(*X, scale=3),), {}),
    # |x| <= 5: beyond it even fp64's 1 + tanh(u) in torch's formula cancels, and the reference is the inaccurate one
    ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), lambda: (randn(*X, scale=2).clamp(-5, 5),), {}),
    ("silu", F.silu, lambda: (randn(*X, scale=4),), {}),
    ("mish", F.mish, lambda: (randn(*X, scale=4),), {}),
    ("softplus", F.softplus, lambda: (with_values(randn(*X, scale=3), 1.5),), {"beta": 2.0, "threshold": 3.0}),
    ("softplus", F.softplus, lambda: (randn(*X, scale=8),), {"beta": 1.0, "threshold": 20.0}),
    ("hardsigmoid", F.hardsigmoid, lambda: (with_values(randn(*X, scale=4), -3.0, 3.0),), {}),
    ("hardswish", F.hardswish, lambda: (with_values(randn(*X, scale=4), -3.0, 3.0),), {}),
    ("clamp", torch.clamp, lambda: (with_values(randn(*X, scale=2), -0.5, 0.75), -0.5, 0.75), {}),
    ("clamp", torch.clamp, lambda: (randn(4, 5, 6, scale=2), randn(*Y), randn(6)), {}),  # tensor bounds, some min > max
    ("clamp_min", torch.clamp_min, lambda: (randn(*X), randn(*Y)), {}),
    ("clamp_max", torch.clamp_max, lambda: (with_values(randn(*X), 0.25), 0.25), {}),  # bounds exact in fp32
    ("maximum", torch.maximum, lambda: (ints(*X), ints(*Y)), {}),  # ties split the gradient
    ("minimum", torch.minimum, lambda: (ints(*X), ints(*Y)), {}),
    ("where", torch.where, lambda: (randn(*X) > 0, randn(*Y), randn(*X)), {}),
    ("where", torch.where, lambda: (randn(*X) > 0, randn(*Y), 0.0), {}),
    ("masked_fill", torch.masked_fill, lambda: (randn(*X), randn(*Y) > 0, -1.5), {}),
    ("masked_fill", torch.masked_fill, lambda: (randn(*X), randn(*Y) > 0, randn()), {}),  # a 0-dim tensor
    ("masked_fill", torch.masked_fill, lambda: (randn(*X), randn(*Y) > 0, -math.inf), {}),
    *[(name, getattr(torch, name), lambda: (ints(*X), ints(*Y)), {}) for name in ("eq", "ne", "lt", "le", "gt", "ge")],
    *[(name, getattr(torch, name), lambda: (ints(*X, lo=-1, hi=2), ints(*Y, lo=-1, hi=2)), {})
      for name in ("logical_and", "logical_or", "logical_xor")],
    ("logical_not", torch.logical_not, lambda: (ints(*X, lo=-1, hi=2),), {}),
    *[(name, getattr(torch, name), lambda: (with_values(randn(*X, scale=1e38), math.nan, math.inf, -math.inf),), {})
      for name in ("isnan", "isinf", "isfinite")],
    *[("to_dtype", lambda x, dtype: x.to(dtype), UNARY, {"dtype": d})
      for d in (torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.bool)],
    ("to_dtype", lambda x, dtype: x.to(dtype), lambda: (torch.randint(-5, 5, X, generator=GEN),), {"dtype": torch.float32}),
    # Python scalars as operands
    ("add", lambda x, y, alpha: torch.add(x, y, alpha=alpha), lambda: (randn(*X), 3), {"alpha": 1}),
    ("mul", torch.mul, lambda: (randn(*X), -1.5), {}),
    ("div", torch.div, lambda: (1.0, away_from_zero(*Y)), {}),
    ("gt", torch.gt, lambda: (randn(*X), 0.5), {}),
    *[(name, getattr(torch, name), lambda: (randn(*X) > 0, ints(*Y, lo=-1, hi=2)), {})  # a bool operand
      for name in ("logical_and", "logical_or", "logical_xor")],
]
CASE_IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]
# Absolute tolerances where fp32 cannot do better: 1 + erf(x / sqrt 2) cancels for x << 0 (as in torch's
# own kernel; tl has no erfc); x - floor(x / y) * y rounds at x's magnitude (torch has an exact fmod);
# x + v * y * z rounds differently from torch's fused kernel where the terms cancel.
ATOL = {"gelu": 1e-6, "remainder": 1e-5, "fmod": 1e-5, "addcmul": 1e-6, "addcdiv": 1e-6}
