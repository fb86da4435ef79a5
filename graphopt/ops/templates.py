"""Building and rendering Triton expression templates.

A template is a Python format string over an op's operand and param names (`{x}`, `{alpha}`), plus
`{g}` (incoming gradient) and `{out}` (forward result) in derivative templates. Everything is fp32
and uses only triton.language functions that also run under TRITON_INTERPRET=1 (no libdevice), so
expm1, log1p, tanh and pow are spelled here with the accuracy tricks they need.
"""
from __future__ import annotations

import math


def render(template: str, **values) -> str:
    """Substitute operands/params into a template; each value is parenthesised so that templates
    compose (a rendered expression can be a value) and negative literals stay negative."""
    return template.format_map({k: f"({literal(v)})" for k, v in values.items()})


def literal(v) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, float) and not math.isfinite(v):
        return f'float("{v}")'
    return repr(v)


def expm1(a: str) -> str:
    # Kahan: (u - 1) * a / log(u) cancels exp's rounding error near 0, where exp(a) - 1 loses digits.
    u = f"tl.exp({a})"
    return f"tl.where(tl.abs({a}) < 0.5, tl.where({u} == 1.0, {a}, ({u} - 1.0) * {a} / tl.log({u})), {u} - 1.0)"


def log1p(a: str) -> str:
    # Kahan: log(u) * a / (u - 1) with u = 1 + a compensates the rounding of 1 + a near 0.
    u = f"(1.0 + {a})"
    return f"tl.where(tl.abs({a}) < 0.5, tl.where({u} == 1.0, {a}, tl.log({u}) * {a} / ({u} - 1.0)), tl.log({u}))"


def tanh(a: str) -> str:
    # tanh|a| = -expm1(-2|a|) / (2 + expm1(-2|a|)); the naive 2*sigmoid(2a) - 1 cancels near 0.
    e = expm1(f"-2.0 * tl.abs({a})")
    return f"tl.where({a} < 0, 1.0, -1.0) * ({e}) / (2.0 + {e})"


def pow_(a: str, b: str) -> str:
    # exp(b * log a) for a > 0; a < 0 needs an integer b (else log of a negative gives NaN, as torch
    # does) and the sign of an odd power; a**0 is 1 even for a == 0.
    odd = f"({b} - 2.0 * tl.floor({b} * 0.5))"
    neg = f"(1.0 - 2.0 * {odd}) * tl.exp({b} * tl.log(tl.where({b} == tl.floor({b}), -{a}, {a})))"
    return f"tl.where({b} == 0, 1.0, tl.where({a} < 0, {neg}, tl.exp({b} * tl.log({a}))))"


def pow_scalar(a: str, b: str) -> str:
    # A constant exponent of 1, 2 or 3 is multiplication, as torch computes it (exactly, where exp(b * log a)
    # rounds twice); the conditions are constants the compiler folds. The general form gets a float exponent:
    # Triton's compiler takes no integer in tl.floor (its interpreter does).
    general = pow_(a, f"({b} * 1.0)")
    return (f"tl.where({b} == 1, {a}, tl.where({b} == 2, {a} * {a}, "
            f"tl.where({b} == 3, {a} * {a} * {a}, {general})))")


def softplus(a: str, beta: str, threshold: str) -> str:
    return f"tl.where({a} * {beta} > {threshold}, {a}, ({log1p(f'tl.exp({a} * {beta})')}) / {beta})"


def trunc(a: str) -> str:
    return f"tl.where({a} < 0, tl.ceil({a}), tl.floor({a}))"


def round_half_even(a: str) -> str:
    # a - floor(a) is exact, so ties are detected exactly; floor(a + 0.5) would round 0.49999997 up.
    f = f"tl.floor({a})"
    d = f"({a} - {f})"
    return f"tl.where({d} > 0.5, {f} + 1.0, tl.where({d} < 0.5, {f}, {f} + ({f} - 2.0 * tl.floor({f} * 0.5))))"
