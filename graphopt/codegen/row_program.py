"""A row group's forward and backward as single-assignment lines over fp32 values, for the row
kernels (row_kernel.py) to lay out: straight in one block, or in passes over column chunks.

A Line assigns one name once. Its kind says how many values a row has (row_group.py: FULL and
COL are a block per chunk of columns, ROW is one scalar); a reduce line ("sum" or "max") is ROW
and reduces its FULL expression over the row's columns. Loads and stores are data too, so the
layout alone decides where they go.

Forward: a load per input, a line per step (an elementwise op's registry template, program.py;
a reduction; a softmax's max, exponentials, sum and quotient), a store per output.
Backward (reverse mode, the forward recomputed in place of saved intermediates, or read from a
stored output where the caller keeps it):
1. The forward's lines; each output's incoming gradient loaded as its step's first term.
2. Steps in reverse: once every term of a step's adjoint is known (its users come after it), the
   adjoint is their sum; then each derivative template is a term for its arg, kind-shaped: a
   FULL step's term for a ROW value is reduced over the row (a reduce line); a reduction's term
   for its FULL arg is broadcast (sum), or shared among the elements equal to the maximum (max,
   as torch.amax's backward: the count of ties is a reduce line too); a softmax's term is formed
   from its output y alone, as eager's backward forms it: y * (a - sum(a * y)), or for
   log_softmax a - exp(y) * sum(a). Its max is a shift the result does not depend on: no
   gradient flows through it, so the backward reads no input of it where y is stored.
3. Each input that wants a gradient: the sum of its terms, stored; a COL input's summed over the
   rows of the program (the launcher adds the programs' partial sums up).
4. Only the lines the stores need are kept: an input whose value no derivative reads is not
   loaded (an add's operands), and a step read from its stored output needs nothing before it
   (a residual add before a norm: the norm's backward reads the sum, not the addends).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..ops.templates import render
from .group import is_ref, op_info
from .program import ROUND, forward_expr, operand_values, rounded
from .row_group import COL, FULL, ROW, Reduce, RowGroup, Softmax, remembered


@dataclass(frozen=True)
class Line:
    target: str
    kind: str  # FULL, ROW or COL
    expr: str  # a load's pointer kind for loads; for a reduce line, the FULL expression it reduces
    reads: tuple[str, ...] = ()
    reduce: str | None = None  # "sum" or "max"
    load: bool = False
    comment: str = ""


@dataclass(frozen=True)
class Store:
    pointer: str  # out{i} or d{k}
    kind: str  # where it goes: FULL (row * C + cols), ROW (row), or COL: a sum over the program's rows
    value: str
    dtype: torch.dtype = torch.float32  # the tensor's: a half one is written rounded (to nearest even)


@dataclass(frozen=True)
class RowProgram:
    pointers: tuple[str, ...]  # in signature order
    lines: tuple[Line, ...]
    stores: tuple[Store, ...]
    grads: tuple[int, ...] = ()  # backward: inputs whose gradient is stored


def _name(ref) -> str:
    return f"{'x' if ref[0] == 'input' else 'v'}{ref[1]}"


def _names(expr: str, known) -> tuple[str, ...]:
    """The names of `known` that expr reads (whole words)."""
    return tuple(dict.fromkeys(w for w in re.findall(r"\b[a-z]\w*\b", expr) if w in known))


class _Lines:
    def __init__(self):
        self.lines: list[Line] = []
        self.kinds: dict[str, str] = {}
        self._count = 0

    def add(self, target: str, kind: str, expr: str, reduce: str | None = None, load: bool = False,
            comment: str = "") -> str:
        self.lines.append(Line(target, kind, expr, () if load else _names(expr, self.kinds), reduce, load, comment))
        self.kinds[target] = kind
        return target

    def temp(self, kind: str, expr: str, reduce: str | None = None, comment: str = "") -> str:
        self._count += 1
        return self.add(f"t{self._count}", kind, expr, reduce, comment=comment)


def _forward(group: RowGroup, lines: _Lines, loaded=frozenset()) -> None:
    """The forward's lines; a step in `loaded` is read from its stored output (pointer v{j}). A
    step of a half dtype is rounded to it, as eager materializes it."""
    for k in range(len(group.inputs)):
        if group.is_index(k):
            lines.add(f"x{k}", COL, "cols.to(tl.float32)", comment="the column index")
        else:
            lines.add(f"x{k}", group.input_kind(k), group.input_kind(k), load=True)
    for j, s in enumerate(group.steps):
        dtype = group.dtypes[j]
        if j in loaded:
            lines.add(f"v{j}", group.step_kind(j), group.step_kind(j), load=True)
        elif isinstance(s, Reduce) and dtype in ROUND:
            total = lines.temp(ROW, _name(s.arg), reduce=s.kind, comment=f"row_{s.kind}")
            lines.add(f"v{j}", ROW, rounded(total, dtype), comment=f"rounded to {dtype}")
        elif isinstance(s, Reduce):
            lines.add(f"v{j}", ROW, _name(s.arg), reduce=s.kind, comment=f"row_{s.kind}")
        elif isinstance(s, Softmax):
            _softmax(j, s, lines, dtype)
        else:
            lines.add(f"v{j}", group.step_kind(j), forward_expr(s, dtype), comment=s.op)


def _softmax(j: int, s: Softmax, lines: _Lines, dtype: torch.dtype) -> None:
    x = _name(s.arg)
    peak = lines.temp(ROW, x, reduce="max", comment=f"{s.op}: the row's max")
    shifted = lines.temp(FULL, f"{x} - {peak}")
    exp = render(op_info("exp").triton, x=shifted)
    if s.log:
        total = lines.temp(ROW, exp, reduce="sum")
        value = f"{shifted} - {render(op_info('log').triton, x=total)}"
    else:
        e = lines.temp(FULL, exp)
        value = f"{e} / {lines.temp(ROW, e, reduce='sum')}"
    lines.add(f"v{j}", FULL, rounded(value, dtype), comment=s.op)


def forward_program(group: RowGroup) -> RowProgram:
    return remembered(group, "forward", lambda: _forward_program(group))


def _forward_program(group: RowGroup) -> RowProgram:
    lines = _Lines()
    _forward(group, lines)
    stores = tuple(Store(f"out{i}", group.step_kind(j), f"v{j}", group.dtypes[j]) for i, j in enumerate(group.outputs))
    return RowProgram(_read(group) + tuple(s.pointer for s in stores), tuple(lines.lines), stores)


def _read(group: RowGroup) -> tuple[str, ...]:
    return tuple(f"x{k}" for k in range(len(group.inputs)) if not group.is_index(k))


def _dtype(group: RowGroup, ref) -> torch.dtype:
    return group.inputs[ref[1]].dtype if ref[0] == "input" else group.dtypes[ref[1]]


def _term(group: RowGroup, j: int, arg, kind: str, expr: str, lines: _Lines, comment: str,
          reduce: str | None = None) -> str:
    """A line for step j's term for arg: rounded to step j's dtype where that is half (eager's
    backward makes it in that dtype; not where j ends a norm, whose backward is one kernel), then to arg's where arg is a half value at full size (a
    reduced term is summed in fp32, its lanes being the kernel's)."""
    expr = expr if j in group.fp32_terms else rounded(expr, group.dtypes[j])
    if kind == FULL and not reduce and group.ref_kind(arg) == FULL:
        expr = rounded(expr, _dtype(group, arg)) if _dtype(group, arg) != group.dtypes[j] else expr
    return lines.temp(kind, expr, reduce, comment)


def _terms(group: RowGroup, j: int, adjoint: str, lines: _Lines) -> list[tuple[tuple, str]]:
    """(arg ref, name of its term) for each arg of step j a gradient flows into (Step 2)."""
    s, kind = group.steps[j], group.step_kind(j)
    if isinstance(s, Reduce):
        if s.kind == "sum":
            return [(s.arg, _term(group, j, s.arg, FULL, adjoint, lines, f"d row_sum(step {j})"))
                    if _dtype(group, s.arg) in ROUND else (s.arg, adjoint)]
        ties = lines.temp(FULL, f"tl.where({_name(s.arg)} == v{j}, 1.0, 0.0)", comment="elements equal to the max")
        count = lines.temp(ROW, ties, reduce="sum", comment="how many")
        return [(s.arg, _term(group, j, s.arg, FULL, f"{adjoint} * {ties} / {count}", lines, f"d row_max(step {j})"))]
    if isinstance(s, Softmax):
        if s.log:
            total = lines.temp(ROW, adjoint, reduce="sum")
            term = f"{adjoint} - {render(op_info('exp').triton, x=f'v{j}')} * {total}"
        else:
            total = lines.temp(ROW, f"{adjoint} * v{j}", reduce="sum")
            term = f"v{j} * ({adjoint} - {total})"
        return [(s.arg, _term(group, j, s.arg, FULL, term, lines, f"d {s.op}(step {j})"))]
    op, out = op_info(s.op), []
    for i, a in enumerate(s.args):
        if not is_ref(a) or op.derivatives[i] is None:
            continue
        term = render(op.derivatives[i], g=adjoint, out=f"v{j}", **operand_values(s))
        comment = f"d {s.op}(step {j}) / d {_name(a)}"
        reduced = kind == FULL and group.ref_kind(a) == ROW
        out.append((a, _term(group, j, a, ROW if reduced else kind, term, lines, comment, "sum" if reduced else None)))
    return out


def _adjoint(group: RowGroup, ref, names: list[str]) -> str:
    """The sum of a value's terms: in its dtype where it is a half value at full size (eager adds
    gradients in the tensor's dtype), else in fp32."""
    dtype = _dtype(group, ref)
    if dtype not in ROUND or group.ref_kind(ref) != FULL:
        return _sum(names)
    total = names[0]
    for name in names[1:]:
        total = rounded(f"{total} + {name}", dtype)
    return total


def _sum(names: list[str]) -> str:
    return " + ".join(names)


def backward_program(group: RowGroup, has_grad, needs, loaded=frozenset()) -> RowProgram:
    """has_grad[i]: output i has an incoming gradient; needs[k]: input k wants one; loaded: steps
    whose stored outputs the backward reads instead of recomputing them (Step 4)."""
    key = ("backward", tuple(map(bool, has_grad)), tuple(map(bool, needs)), frozenset(loaded))
    return remembered(group, key, lambda: _backward_program(group, *key[1:]))


def _backward_program(group: RowGroup, has_grad: tuple, needs: tuple, loaded: frozenset) -> RowProgram:
    lines = _Lines()
    _forward(group, lines, loaded)
    terms: dict[tuple, list[str]] = {}
    seeded = [i for i, g in enumerate(has_grad) if g]
    for i in seeded:
        j = group.outputs[i]
        terms.setdefault(("step", j), []).append(lines.add(f"g{i}", group.step_kind(j), group.step_kind(j), load=True))
    for j in reversed(range(len(group.steps))):
        if ("step", j) not in terms:
            continue
        adjoint = lines.add(f"a{j}", group.step_kind(j), _adjoint(group, ("step", j), terms[("step", j)]),
                            comment=f"adjoint of step {j}")
        for a, term in _terms(group, j, adjoint, lines):
            terms.setdefault(a, []).append(term)
    grads = tuple(k for k in range(len(group.inputs)) if needs[k] and ("input", k) in terms and not group.is_index(k))
    stores = []
    for k in grads:
        kind = group.input_kind(k)
        lines.add(f"d{k}", kind, _adjoint(group, ("input", k), terms[("input", k)]), comment=f"gradient of input {k}")
        stores.append(Store(f"d{k}", kind, f"d{k}", group.inputs[k].dtype))
    live = _live(lines.lines, stores)
    loads = {line.target for line in live if line.load}
    pointers = tuple(p for p in _read(group) + tuple(f"v{j}" for j in sorted(loaded)) + tuple(f"g{i}" for i in seeded)
                     if p in loads) + tuple(s.pointer for s in stores)
    return RowProgram(pointers, tuple(live), tuple(stores), grads)


def _live(lines: list[Line], stores) -> list[Line]:
    """The lines the stores need, in order (what a backward never reads it neither loads nor computes)."""
    needed, kept = {s.value for s in stores}, []
    for line in reversed(lines):
        if line.target in needed:
            kept.append(line)
            needed.update(line.reads)
    return kept[::-1]


def backward_reads(group: RowGroup, has_grad, needs, loaded=frozenset()) -> tuple[set[int], set[int]]:
    """(inputs, loaded steps) the backward program reads: what a fused op must keep for it."""
    pointers = backward_program(group, has_grad, needs, loaded).pointers
    return ({k for k in range(len(group.inputs)) if f"x{k}" in pointers},
            {j for j in loaded if f"v{j}" in pointers})


def vector(kind: str) -> bool:
    """Whether a value of this kind is a block of columns (FULL, COL) rather than a scalar (ROW)."""
    return kind in (FULL, COL)
