"""Elementwise ops: operands, scalar params, Triton expression and per-operand derivative templates.

Each row is  name: (operands, triton, derivatives[, params]).  A derivative template is the gradient
contribution to that operand at the broadcast output shape (the caller sum-reduces it back to the
operand's shape); None marks an operand autograd does not differentiate (a comparison, where's
condition). Integer operands are computed in fp32 too (the codegen upcasts), so integer // and % are
only exact while x / y rounds far from an integer: small operands, not int64 index arithmetic.
"""
from .templates import expm1, log1p, pow_, pow_scalar, round_half_even, softplus, tanh, trunc

ZERO = "0.0 * {g}"  # piecewise-constant ops: autograd returns zeros, not "no gradient"
NOT_DIFF2 = (None, None)
SIGN = "(tl.where({x} > 0, 1.0, 0.0) - tl.where({x} < 0, 1.0, 0.0))"
TRUNC_Q = trunc("({x} / {y})")
GELU_TANH_U2 = "1.5957691216057308 * ({x} + 0.044715 * {x} * {x} * {x})"  # 2u; 0.5 (1 + tanh u) = sigmoid(2u)
GELU_TANH_SIG = f"tl.sigmoid({GELU_TANH_U2})"
GELU_CDF = "0.5 * (1.0 + tl.erf({x} * 0.7071067811865476))"
MISH_SP = softplus("{x}", "1.0", "20.0")
MISH_TANH = tanh(MISH_SP)


def _extremum_grad(a, b, wins):
    # the winner takes the gradient; a tie splits it, as autograd does
    return f"{{g}} * tl.where({a} {wins} {b}, 1.0, tl.where({a} == {b}, 0.5, 0.0))"


def _inside(lo, lo_cmp, hi_cmp, hi):
    return f"tl.where(({{x}} {lo_cmp} {lo}) & ({{x}} {hi_cmp} {hi}), {{g}}, 0.0)"


TABLE = {
    # arithmetic
    "add": ("x y", "{x} + {alpha} * {y}", ("{g}", "{alpha} * {g}"), {"alpha": 1}),
    "sub": ("x y", "{x} - {alpha} * {y}", ("{g}", "-{alpha} * {g}"), {"alpha": 1}),
    "mul": ("x y", "{x} * {y}", ("{g} * {y}", "{g} * {x}")),
    "div": ("x y", "{x} / {y}", ("{g} / {y}", "-{g} * {x} / ({y} * {y})")),
    "div_trunc": ("x y", TRUNC_Q, (ZERO, ZERO)),
    "div_floor": ("x y", "tl.floor({x} / {y})", (ZERO, ZERO)),
    "remainder": ("x y", "{x} - tl.floor({x} / {y}) * {y}", ("{g}", "-{g} * tl.floor({x} / {y})")),
    "fmod": ("x y", "{x} - " + TRUNC_Q + " * {y}", ("{g}", "-{g} * " + TRUNC_Q)),
    "pow": ("x y", pow_("{x}", "{y}"), (
        "tl.where({y} == 0, 0.0, {g} * {y} * " + pow_("{x}", "({y} - 1.0)") + ")",
        "tl.where(({x} == 0) & ({y} >= 0), 0.0, {g} * {out} * tl.log({x}))")),
    "pow_scalar": ("x", pow_scalar("{x}", "{exponent}"), (
        "tl.where({exponent} == 0, 0.0, {g} * {exponent} * " + pow_scalar("{x}", "({exponent} - 1)") + ")",),
        {"exponent": None}),
    "addcmul": ("x y z", "{x} + {value} * {y} * {z}",
                ("{g}", "{g} * {value} * {z}", "{g} * {value} * {y}"), {"value": 1}),
    "addcdiv": ("x y z", "{x} + {value} * {y} / {z}",
                ("{g}", "{g} * {value} / {z}", "-{g} * {value} * {y} / ({z} * {z})"), {"value": 1}),
    "neg": ("x", "-{x}", ("-{g}",)),
    "abs": ("x", "tl.abs({x})", ("{g} * " + SIGN,)),
    "sign": ("x", SIGN, (ZERO,)),
    "reciprocal": ("x", "1.0 / {x}", ("-{g} * {out} * {out}",)),
    "square": ("x", "{x} * {x}", ("2.0 * {g} * {x}",)),
    "sqrt": ("x", "tl.sqrt({x})", ("{g} / (2.0 * {out})",)),
    "rsqrt": ("x", "tl.rsqrt({x})", ("-0.5 * {g} * {out} * {out} * {out}",)),
    # transcendental
    "exp": ("x", "tl.exp({x})", ("{g} * {out}",)),
    "expm1": ("x", expm1("{x}"), ("{g} * tl.exp({x})",)),  # not out + 1: it cancels where out is near -1
    "log": ("x", "tl.log({x})", ("{g} / {x}",)),
    "log1p": ("x", log1p("{x}"), ("{g} / (1.0 + {x})",)),
    "log2": ("x", "tl.log({x}) * 1.4426950408889634", ("{g} * 1.4426950408889634 / {x}",)),
    "log10": ("x", "tl.log({x}) * 0.4342944819032518", ("{g} * 0.4342944819032518 / {x}",)),
    "sin": ("x", "tl.sin({x})", ("{g} * tl.cos({x})",)),
    "cos": ("x", "tl.cos({x})", ("-{g} * tl.sin({x})",)),
    # 1 - tanh^2 = 4 sigmoid(2x) sigmoid(-2x), sigmoid' likewise: 1 - out cancels where out is near 1
    "tanh": ("x", tanh("{x}"), ("4.0 * {g} * tl.sigmoid(2.0 * {x}) * tl.sigmoid(-2.0 * {x})",)),
    "sigmoid": ("x", "tl.sigmoid({x})", ("{g} * tl.sigmoid({x}) * tl.sigmoid(-{x})",)),
    "erf": ("x", "tl.erf({x})", ("{g} * 1.1283791670955126 * tl.exp(-{x} * {x})",)),
    # rounding
    "floor": ("x", "tl.floor({x})", (ZERO,)),
    "ceil": ("x", "tl.ceil({x})", (ZERO,)),
    "trunc": ("x", trunc("{x}"), (ZERO,)),
    "round": ("x", round_half_even("{x}"), (ZERO,)),
    # activations; at a kink the gradient takes the side autograd takes
    "relu": ("x", "tl.maximum({x}, 0.0)", ("tl.where({out} > 0, {g}, 0.0)",)),
    "relu6": ("x", "tl.minimum(tl.maximum({x}, 0.0), 6.0)", (_inside("0.0", ">", "<", "6.0"),)),
    "hardtanh": ("x", "tl.minimum(tl.maximum({x}, {min_val}), {max_val})",
                 (_inside("{min_val}", ">", "<", "{max_val}"),), {"min_val": -1.0, "max_val": 1.0}),
    "leaky_relu": ("x", "tl.where({x} > 0, {x}, {x} * {negative_slope})",
                   ("tl.where({x} > 0, {g}, {g} * {negative_slope})",), {"negative_slope": 0.01}),
    "elu": ("x", "tl.where({x} > 0, {scale} * {x}, {scale} * {alpha} * (" + expm1("({x} * {input_scale})") + "))",
            ("{g} * {scale} * tl.where({x} > 0, 1.0, {alpha} * {input_scale} * tl.exp({x} * {input_scale}))",),
            {"alpha": 1.0, "scale": 1.0, "input_scale": 1.0}),
    "gelu": ("x", "{x} * " + GELU_CDF,
             ("{g} * (" + GELU_CDF + " + {x} * 0.3989422804014327 * tl.exp(-0.5 * {x} * {x}))",)),
    "gelu_tanh": ("x", "{x} * " + GELU_TANH_SIG,
                  (f"{{g}} * ({GELU_TANH_SIG} + {{x}} * 2.0 * {GELU_TANH_SIG} * tl.sigmoid(-{GELU_TANH_U2})"
                   " * 0.7978845608028654 * (1.0 + 0.134145 * {x} * {x}))",)),
    "silu": ("x", "{x} * tl.sigmoid({x})", ("{g} * tl.sigmoid({x}) * (1.0 + {x} * tl.sigmoid(-{x}))",)),
    "mish": ("x", "{x} * " + MISH_TANH,
             (f"{{g}} * ({MISH_TANH} + 4.0 * {{x}} * tl.sigmoid({{x}}) * tl.sigmoid(2.0 * ({MISH_SP}))"
              f" * tl.sigmoid(-2.0 * ({MISH_SP})))",)),
    "softplus": ("x", softplus("{x}", "{beta}", "{threshold}"),
                 ("tl.where({x} * {beta} > {threshold}, {g}, {g} * tl.sigmoid({x} * {beta}))",),
                 {"beta": 1.0, "threshold": 20.0}),
    "hardsigmoid": ("x", "tl.minimum(tl.maximum({x} + 3.0, 0.0), 6.0) / 6.0",
                    ("tl.where(({x} > -3.0) & ({x} < 3.0), {g} / 6.0, 0.0)",)),
    "hardswish": ("x", "{x} * tl.minimum(tl.maximum({x} + 3.0, 0.0), 6.0) / 6.0",
                  ("tl.where({x} <= -3.0, 0.0, tl.where({x} < 3.0, {g} * ({x} / 3.0 + 0.5), {g}))",)),
    # clamping and selection; clamp's bounds are operands because torch accepts tensors for them
    "clamp": ("x min max", "tl.minimum(tl.maximum({x}, {min}), {max})", (
        _inside("{min}", ">=", "<=", "{max}"),
        "tl.where(({x} < {min}) & ({min} < {max}), {g}, 0.0)",
        "tl.where(({x} > {max}) | ({max} < {min}), {g}, 0.0)")),
    "clamp_min": ("x min", "tl.maximum({x}, {min})",
                  ("tl.where({x} >= {min}, {g}, 0.0)", "tl.where({x} < {min}, {g}, 0.0)")),
    "clamp_max": ("x max", "tl.minimum({x}, {max})",
                  ("tl.where({x} <= {max}, {g}, 0.0)", "tl.where({x} > {max}, {g}, 0.0)")),
    "maximum": ("x y", "tl.maximum({x}, {y})", (_extremum_grad("{x}", "{y}", ">"), _extremum_grad("{y}", "{x}", ">"))),
    "minimum": ("x y", "tl.minimum({x}, {y})", (_extremum_grad("{x}", "{y}", "<"), _extremum_grad("{y}", "{x}", "<"))),
    "where": ("cond x y", "tl.where({cond} != 0, {x}, {y})",
              (None, "tl.where({cond} != 0, {g}, 0.0)", "tl.where({cond} != 0, 0.0, {g})")),
    "masked_fill": ("x mask value", "tl.where({mask} != 0, {value}, {x})",
                    ("tl.where({mask} != 0, 0.0, {g})", None, "tl.where({mask} != 0, {g}, 0.0)")),
    # comparisons and logic: bool results, no gradient
    "eq": ("x y", "{x} == {y}", NOT_DIFF2),
    "ne": ("x y", "{x} != {y}", NOT_DIFF2),
    "lt": ("x y", "{x} < {y}", NOT_DIFF2),
    "le": ("x y", "{x} <= {y}", NOT_DIFF2),
    "gt": ("x y", "{x} > {y}", NOT_DIFF2),
    "ge": ("x y", "{x} >= {y}", NOT_DIFF2),
    "logical_and": ("x y", "({x} != 0) & ({y} != 0)", NOT_DIFF2),
    "logical_or": ("x y", "({x} != 0) | ({y} != 0)", NOT_DIFF2),
    "logical_xor": ("x y", "({x} != 0) != ({y} != 0)", NOT_DIFF2),
    "logical_not": ("x", "{x} == 0", (None,)),
    "isnan": ("x", "{x} != {x}", (None,)),
    "isinf": ("x", "tl.abs({x}) > 3.4028234663852886e38", (None,)),  # beyond fp32's largest finite value
    "isfinite": ("x", "tl.abs({x}) <= 3.4028234663852886e38", (None,)),
    # integer bit operations have no fp32 form; on bool tensors lookup resolves them to logical_*
    "bitwise_and": ("x y", None, NOT_DIFF2),
    "bitwise_or": ("x y", None, NOT_DIFF2),
    "bitwise_xor": ("x y", None, NOT_DIFF2),
    "bitwise_not": ("x", None, (None,)),
    # the codegen casts on store, so a cast is the identity in fp32
    "to_dtype": ("x", "{x}", ("{g}",), {"dtype": None}),
}

# In-place forms that change the result dtype (x.eq_(y) writes 0/1 into x's dtype) are not twins.
NO_TWIN = {"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor", "logical_not", "to_dtype"}

SPECS = {name: dict(kind="elementwise", operands=tuple(row[0].split()), triton=row[1], derivatives=row[2],
                    params=tuple(row[3].items()) if len(row) > 3 else ())
         for name, row in TABLE.items()}
SPECS["to_dtype"]["aliases"] = True  # x.to(x.dtype) returns x itself
