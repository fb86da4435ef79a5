"""The group as straight-line code over fp32 values, shared by the Triton kernels and the torch reference.

Names: x{k} input k, v{j} step j's value, g{i} the incoming gradient of output i, a{j} step j's adjoint,
d{k} input k's gradient. Expressions use only `tl.<function>` calls that graphopt.ops.shim also maps to
torch, so the same text runs in a Triton kernel and on torch tensors.

Forward:
1. Each step renders its registry template over its args' names (scalars as fp32 literals).
2. A comparison's bool becomes 1.0/0.0; a cast to an integer truncates, one to bool tests != 0, since
   the value stays fp32 in between.
3. A step whose dtype is fp16 or bf16 is rounded to it (to nearest even) and kept in fp32: eager
   materializes every intermediate in its dtype, so the next step must read the rounded value, or
   sigmoid(x) - sigmoid(x).half() is not 0 (Inductor's emulate_precision_casts). A cast to fp16/bf16
   is such a step. A weak operand (a Python scalar, a 0-dim fp32 tensor) is read in fp32, as eager's
   mul and div read it; eager's add, sub and comparisons (on CPU at least) round it to the step's dtype
   first, which the registry does not record, so there a fused result can differ by that rounding.

Backward (reverse mode over the steps, recomputing the forward in place of saved intermediates):
1. Adjoints exist for float steps on a path from an input that needs a gradient to an output that
   has one.
2. Each output's incoming gradient seeds its step's adjoint.
3. Steps in reverse: each derivative template (in {g} = the step's adjoint, {out} = its value, its
   operands and params) is a contribution to the adjoint of the arg it differentiates; None entries,
   scalar args and non-float args get none.
4. The live forward code: the values the contributions read, and the steps those are computed from.
   It is the forward's code, so it reads the rounded values of forward step 3, as eager's backward
   reads the saved half tensors.
5. Rounding, as eager's autograd materializes gradients: a derivative is a tensor of its step's dtype,
   summed over the broadcast dims of its target, then cast to the target's dtype, and a value's
   gradients are added in its dtype. So a contribution is rounded to its step's dtype when that is
   fp16/bf16; where its target is an fp16/bf16 value at the group's full shape (nothing to sum over),
   also to the target's dtype, and so is the target's adjoint after each addition. A smaller target's
   reduction spans lanes, which the kernel cannot form: its terms are added in fp32, and for an input
   the runtime's final sum and cast round as eager's cast after its reduction. A derivative template
   is one fp32 expression: where eager's backward rounds between kernels (div's), or reads the rounded
   output where the template reads the input (sigmoid's, tanh's), gradients differ by more than that.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..ops.templates import render, trunc
from .group import Group, differentiable, is_comparison, is_ref, op_info


def name(arg) -> str:
    """The variable (or fp32 literal) an arg reads."""
    if is_ref(arg):
        return f"{'x' if arg[0] == 'input' else 'v'}{arg[1]}"
    return float(arg)


def operand_values(step) -> dict:
    op = op_info(step.op)
    return {**dict(zip(op.operands, map(name, step.args))), **step.params}


# the helpers that round an fp32 value to the nearest fp16/bf16 and back: kernel.py defines them for
# Triton, reference.py for torch
ROUND = {torch.float16: "round_fp16", torch.bfloat16: "round_bf16"}


def rounded(expr: str, dtype: torch.dtype) -> str:
    """expr rounded to dtype when that is fp16 or bf16 (Step 3 of the forward, 5 of the backward)."""
    return f"{ROUND[dtype]}({expr})" if dtype in ROUND else expr


def forward_expr(step, dtype: torch.dtype) -> str:
    expr = render(op_info(step.op).triton, **operand_values(step))
    if is_comparison(step.op):
        return f"tl.where({expr}, 1.0, 0.0)"
    if step.op == "to_dtype" and dtype == torch.bool:
        return f"tl.where({expr} != 0, 1.0, 0.0)"
    if step.op == "to_dtype" and not differentiable(dtype):
        return trunc(f"({expr})")  # an integer cast truncates toward zero
    return rounded(expr, dtype)


@dataclass(frozen=True)
class Line:
    target: str
    expr: str
    comment: str


@dataclass(frozen=True)
class Contribution:
    target: str  # a{j} or d{k}
    expr: str
    comment: str
    of: tuple  # the ref whose adjoint this adds to
    rounds: tuple[torch.dtype, ...] = ()  # the dtypes the term is rounded to, in turn (Step 5)
    sums: torch.dtype = torch.float32  # the dtype the target's adjoint is added in (Step 5)

    @property
    def term(self) -> str:
        term = self.expr
        for dtype in self.rounds:
            term = rounded(term, dtype)
        return term

    def accumulate(self, term: str, first: bool) -> str:
        """The target's new value: `term` (this contribution's term, as the caller renders it) added to it."""
        return term if first else rounded(f"{self.target} + {term}", self.sums)


@dataclass(frozen=True)
class Backward:
    forward: tuple[Line, ...]  # the live forward code
    inputs: tuple[int, ...]  # inputs the live code loads
    seeds: tuple[tuple[str, int], ...]  # (adjoint, output position): a{j} starts from g{i}
    contributions: tuple[Contribution, ...]
    grads: tuple[int, ...]  # inputs that get a gradient (d{k})
    rounded_adjoints: tuple[tuple, ...] = ()  # refs rounded to their own dtype: what Step 5 takes from sizes


def forward_lines(group: Group, dtypes, live=None) -> list[Line]:
    return [Line(f"v{j}", forward_expr(s, dtypes[j]), f"{s.op}{_params(s)}")
            for j, s in enumerate(group.steps) if live is None or j in live]


def _params(step) -> str:
    return "" if not step.params else "(" + ", ".join(f"{k}={v}" for k, v in step.params.items()) + ")"


def backward_program(group: Group, input_dtypes, dtypes, has_grad, needs, full) -> Backward:
    """The backward as data; has_grad[i]: output i has an incoming gradient; needs[k]: input k wants one;
    full: the refs whose values span the group's full shape."""
    steps = group.steps
    # Step 1: which refs carry adjoints. Forward sweep: depends on a needed input along float values.
    wanted = {("input", k) for k, d in enumerate(input_dtypes) if needs[k] and differentiable(d)}
    reaches = set(wanted)
    for j, s in enumerate(steps):
        if differentiable(dtypes[j]) and any(_edge(s, i, a) and a in reaches for i, a in enumerate(s.args)):
            reaches.add(("step", j))
    # backward sweep: an output with a gradient depends on it
    seeded = {("step", group.outputs[i]) for i, g in enumerate(has_grad) if g}
    carries = set()
    for j in reversed(range(len(steps))):
        ref = ("step", j)
        if ref in reaches and (ref in seeded or ref in carries):
            carries.add(ref)
            carries.update(a for i, a in enumerate(steps[j].args) if _edge(steps[j], i, a) and a in reaches)
    adjoint_steps = sorted(j for kind, j in carries if kind == "step")
    # Step 2: seeds
    seeds = tuple((f"a{group.outputs[i]}", i) for i, g in enumerate(has_grad) if g and ("step", group.outputs[i]) in carries)
    # Step 5, applied by each contribution: the adjoints rounded to their own dtype
    dtype_of = {**{("input", k): d for k, d in enumerate(input_dtypes)},
                **{("step", j): d for j, d in enumerate(dtypes)}}
    rounded_adjoints = tuple(sorted(a for a in carries if a in full and dtype_of[a] in ROUND))
    # Step 3: contributions, steps in reverse
    contributions = []
    for j in reversed(adjoint_steps):
        s, op = steps[j], op_info(steps[j].op)
        for i, a in enumerate(s.args):
            if not (_edge(s, i, a) and a in carries):
                continue
            expr = render(op.derivatives[i], g=f"a{j}", out=f"v{j}", **operand_values(s))
            target = f"{'d' if a[0] == 'input' else 'a'}{a[1]}"
            sums = dtype_of[a] if a in rounded_adjoints else torch.float32
            rounds = tuple(dict.fromkeys(d for d in (dtypes[j], sums) if d in ROUND))
            contributions.append(Contribution(target, expr, f"d {s.op}(step {j}) / d{op.operands[i]}", a,
                                              rounds, sums))
    grads = tuple(sorted(k for kind, k in carries if kind == "input"))
    # the live forward code: the values the contributions read, and what those are computed from
    read = {(VAR[m[0]], int(m[1])) for c in contributions for m in re.findall(r"\b([vx])(\d+)\b", c.expr)}
    for j in reversed(range(len(steps))):
        if ("step", j) in read:
            read.update(a for a in steps[j].args if is_ref(a))
    live = {j for kind, j in read if kind == "step"}
    loaded = tuple(sorted(k for kind, k in read if kind == "input"))
    return Backward(tuple(forward_lines(group, dtypes, live)), loaded, seeds, tuple(contributions), grads,
                    rounded_adjoints)


VAR = {"v": "step", "x": "input"}


def _edge(step, i, arg) -> bool:
    """Whether a gradient flows from the step into its i-th arg (as far as the op is concerned)."""
    return is_ref(arg) and op_info(step.op).derivatives[i] is not None

