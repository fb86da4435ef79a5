"""The row-group IR: elementwise ops and reductions over the last dimension, one row at a time.

A RowGroup is a Group (group.py) whose program may also reduce a value over its row. Every value
has a class that says which elements it has for a row of C columns:
  FULL: C elements (a [..., C] tensor, the rows being its leading dims);
  ROW:  one element (a [..., 1] tensor: a statistic of the row, or a per-row input);
  COL:  C elements shared by every row (a [C] tensor: a norm's weight or bias);
  INDEX: the column index 0..C-1, which the kernel makes (no tensor: its input is None), a COL
        value for picking the target's logit out of a row (cross-entropy).
A FULL input may be read shifted along the columns (RowInput.shift): column j reads its column
j + shift, 0 past either end; with the column index, a rotation of halves (rotary embeddings'
rotate_half) is two shifted reads and a where.
An elementwise step's class is FULL when its refs mix FULL or COL with ROW, or read FULL; ROW
when it reads only ROW values; COL when only COL values. A Reduce step reads a FULL value and
is ROW: "sum" adds the row's elements, "max" takes the largest (the gradient is shared evenly
among the elements equal to it, as torch.amax's backward does). A Softmax step is FULL: the
softmax (or log_softmax) of a FULL value over its row, one step so that its backward reads its
output alone, as eager's does (row_program.py).

The norms, softmaxes and losses of the graph are written in these steps by the builders below
(rms_norm, layer_norm, softmax, log_softmax), the same spelling the fusion analysis will
recognize in a graph: mean is a sum times 1/C, var a mean of squared deviations.

Everything computes in fp32. Each input has a dtype (float32, bfloat16, float16: loaded and
upcast) and so does each step: the dtype eager makes its value in. A step of a half dtype is
rounded to it (codegen/program.py's rule, as eager materializes it), and so are the values
stored in one; a norm's or softmax's inner steps are float32 and its last is rounded once, as
eager's kernels compute them in float32 and round their output.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch

from .group import Input, Step, Unsupported, checked_step, is_ref

FULL, ROW, COL, INDEX = "full", "row", "col", "index"
REDUCTIONS = ("sum", "max")


FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RowInput(Input):
    kind: str = FULL
    shift: int = 0  # a FULL input read shifted along the columns: column j reads column j + shift (0 past the ends)
    dtype: torch.dtype = torch.float32  # a float input's; an integer input (class indices) says float32
    ignore: int | None = None  # class indices (a cross entropy's target): each a column or this value


@dataclass(frozen=True)
class Reduce:
    kind: str  # "sum" or "max"
    arg: tuple  # ("input", k) or ("step", j): a FULL value

    @property
    def args(self) -> tuple:
        return (self.arg,)


@dataclass(frozen=True)
class Softmax:
    arg: tuple  # a FULL value
    log: bool = False  # log_softmax

    @property
    def args(self) -> tuple:
        return (self.arg,)

    @property
    def op(self) -> str:
        return "log_softmax" if self.log else "softmax"


_DERIVED: dict[int, tuple[weakref.ref, dict]] = {}
_MISSING = object()


def remembered(group: "RowGroup", key, make):
    """make() once per group and key: its programs and kernel text are asked on every call of its fused op,
    and building them takes milliseconds. Kept by the group's identity (its steps' params are dicts: no
    hash), for as long as the group lives."""
    entry = _DERIVED.get(id(group))
    if entry is None or entry[0]() is not group:
        entry = _DERIVED[id(group)] = (weakref.ref(group, lambda _, at=id(group): _DERIVED.pop(at, None)), {})
    found = entry[1].get(key, _MISSING)
    if found is _MISSING:
        found = entry[1][key] = make()
    return found


def combined(kinds) -> str:
    """The class of an elementwise result of values of these classes: ROW or COL when all are,
    FULL otherwise (ROW with COL is FULL, as broadcasting makes it)."""
    kinds = set(kinds)
    return kinds.pop() if len(kinds) == 1 and kinds <= {ROW, COL} else FULL


@dataclass(frozen=True)
class RowGroup:
    inputs: tuple  # RowInput per input
    steps: tuple  # Step (an elementwise op of the registry) or Reduce
    outputs: tuple  # step indices
    origin: tuple = ()
    dtypes: tuple = ()  # per step, the dtype eager makes its value in (float32 where not given)
    fp32_terms: tuple = ()  # steps ending a norm whose eager backward is one float32 kernel: their terms unrounded

    def __post_init__(self):
        for name in ("inputs", "steps", "outputs", "origin", "dtypes", "fp32_terms"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "dtypes", self.dtypes + (torch.float32,) * (len(self.steps) - len(self.dtypes)))
        if len(self.dtypes) != len(self.steps) or not all(d in FLOATS for d in self.dtypes + tuple(i.dtype for i in self.inputs)):
            raise ValueError(f"a row group's inputs and steps are of {', '.join(map(str, FLOATS))}")
        if not all(isinstance(i, RowInput) and i.kind in (FULL, ROW, COL, INDEX) for i in self.inputs):
            raise ValueError("a row group's inputs are RowInputs of kind 'full', 'row', 'col' or 'index'")
        if any(i.shift and i.kind != FULL for i in self.inputs):
            raise ValueError("only a full input is read shifted along its columns")
        kinds, steps = [COL if i.kind == INDEX else i.kind for i in self.inputs], list(self.steps)
        for j, s in enumerate(steps):
            for a in s.args:
                if is_ref(a) and not (0 <= a[1] < (len(kinds) if a[0] == "input" else j)):
                    raise ValueError(f"step {j} refers to {a}, which is not an {a[0]} before it")
            if isinstance(s, (Reduce, Softmax)):
                if isinstance(s, Reduce) and s.kind not in REDUCTIONS:
                    raise ValueError(f"step {j} reduces by {s.kind!r}; a row reduction is one of {REDUCTIONS}")
                if kinds[s.arg[1] if s.arg[0] == "input" else len(self.inputs) + s.arg[1]] != FULL:
                    raise ValueError(f"step {j} reduces {s.arg}, which is not a full row")
            else:  # an elementwise op of the registry with a template, its params completed
                s = steps[j] = checked_step(j, s, len(self.inputs))
            kinds.append(self._step_kind(s, kinds))
        object.__setattr__(self, "steps", tuple(steps))
        object.__setattr__(self, "_kinds", tuple(kinds))
        if not self.outputs or len(set(self.outputs)) != len(self.outputs) or \
                not all(isinstance(j, int) and 0 <= j < len(self.steps) for j in self.outputs):
            raise ValueError(f"outputs {list(self.outputs)} must name distinct steps")
        if any(self.step_kind(j) == COL for j in self.outputs):
            raise ValueError("an output that does not depend on the row: compute it outside the group")

    def _step_kind(self, step, kinds) -> str:
        if isinstance(step, Reduce):
            return ROW
        if isinstance(step, Softmax):
            return FULL
        n = len(self.inputs)
        return combined(kinds[a[1]] if a[0] == "input" else kinds[n + a[1]] for a in step.args if is_ref(a))

    def input_kind(self, k: int) -> str:
        """FULL, ROW or COL (an INDEX input is a COL value)."""
        return self._kinds[k]

    def is_index(self, k: int) -> bool:
        return self.inputs[k].kind == INDEX

    def step_kind(self, j: int) -> str:
        return self._kinds[len(self.inputs) + j]

    def ref_kind(self, ref) -> str:
        return self.input_kind(ref[1]) if ref[0] == "input" else self.step_kind(ref[1])

    def describe(self) -> str:
        return " -> ".join(f"row_{s.kind}" if isinstance(s, Reduce) else s.op for s in self.steps)


INTEGERS = (torch.int32, torch.int64)


def check_row_inputs(group: RowGroup, inputs, missing: bool = False) -> None:
    """ValueError unless an index input is given as None and only it (or, with missing=True, an
    input a backward does not read); Unsupported unless every other input is of its RowInput's
    float dtype, a bool mask, or per-row integers (class indices: the forward kernel checks each is
    a column or the ignored value, so fp32 holds it exactly, columns being fewer than 2**24)."""
    if len(inputs) != len(group.inputs):
        raise ValueError(f"the group has {len(group.inputs)} inputs, got {len(inputs)}")
    for k, t in enumerate(inputs):
        if t is None and missing:
            continue
        if group.is_index(k) != (t is None):
            why = "the column index is made by the kernel: pass None" if t is not None else \
                "None is for the column index only"
            raise ValueError(f"input {k}: {why}")
        if t is None or t.dtype == group.inputs[k].dtype or t.dtype == torch.bool:  # bool: a dropout's mask, 0 or 1
            continue
        if not (t.dtype in INTEGERS and group.input_kind(k) == ROW):
            raise Unsupported(f"input {k} is {t.dtype}, where the group reads {group.inputs[k].dtype}; row kernels "
                              "take float inputs of their group's dtypes and int32/int64 per-row ones")


def check_columns(group: RowGroup, columns: int) -> None:
    """Unsupported where class indices would not be exact in fp32: rows of 2**24 columns or more."""
    if columns >= 2**24 and any(i.ignore is not None for i in group.inputs):
        raise Unsupported(f"rows of {columns} classes: a class index of 2**24 or more is not exact in fp32")


# -- builders: the graph's norms and softmaxes as row programs -------------------------------------


class Builder:
    """A row group written one step at a time: b(op, *args, **params) appends an elementwise step
    of the registry, b("row_sum", x) or b("row_max", x) a reduction, b("softmax", x) or
    b("log_softmax", x) a softmax over the row; each returns the step's ref.
    The fusion analysis writes a graph's group this way, node by node."""

    def __init__(self, kinds=()):
        self.inputs = [RowInput(name, kind) for name, kind in kinds]
        self.steps, self.dtypes, self.fp32_terms = [], [], []

    def input(self, name: str, kind: str, shift: int = 0, dtype: torch.dtype = torch.float32) -> tuple:
        self.inputs.append(RowInput(name, kind, shift, dtype))
        return ("input", len(self.inputs) - 1)

    def __call__(self, op, *args, **params):
        if op in ("softmax", "log_softmax"):
            self.steps.append(Softmax(args[0], op == "log_softmax"))
        else:
            self.steps.append(Reduce(op[4:], args[0]) if op.startswith("row_") else Step(op, args, params))
        self.dtypes.append(torch.float32)
        return ("step", len(self.steps) - 1)

    def class_indices(self, ref, ignore_index: int) -> None:
        """Input ref holds class indices into the row's columns, or ignore_index: the forward kernel
        checks so."""
        if isinstance(ref, tuple) and ref[0] == "input":
            self.inputs[ref[1]] = dataclasses.replace(self.inputs[ref[1]], ignore=int(ignore_index))

    def made_in(self, ref, dtype: torch.dtype, since: int = 0, one_kernel: bool = False) -> None:
        """Step ref's value is eager's in dtype (rounded to it when half), where ref is a step
        made at or after step `since` (a member's own last step, not a value it passes on);
        one_kernel: it ends a norm whose eager backward computes in float32 throughout."""
        if isinstance(ref, tuple) and ref[0] == "step" and ref[1] >= since:
            self.dtypes[ref[1]] = dtype
            if one_kernel:
                self.fp32_terms.append(ref[1])

    def group(self, *outputs, origin=()) -> RowGroup:
        return RowGroup(self.inputs, self.steps, [o[1] for o in outputs], origin, self.dtypes, self.fp32_terms)


def emit_mean(b: Builder, x, columns: int):
    return b("mul", b("row_sum", x), 1.0 / columns)


def emit_rms_norm(b: Builder, x, weight, columns: int, eps: float):
    """x * rsqrt(mean(x * x) + eps) (* weight), as transformers' RMSNorm computes it."""
    y = b("mul", x, b("rsqrt", b("add", emit_mean(b, b("mul", x, x), columns), eps)))
    return y if weight is None else b("mul", y, weight)


def emit_layer_norm(b: Builder, x, weight, bias, columns: int, eps: float):
    """(x - mean) * rsqrt(var + eps) (* weight) (+ bias), var the biased variance."""
    centered = b("sub", x, emit_mean(b, x, columns))
    y = b("mul", centered, b("rsqrt", b("add", emit_mean(b, b("mul", centered, centered), columns), eps)))
    y = y if weight is None else b("mul", y, weight)
    return y if bias is None else b("add", y, bias)


def emit_softmax(b: Builder, x):
    return b("softmax", x)


def emit_log_softmax(b: Builder, x):
    return b("log_softmax", x)


def rms_norm(columns: int, eps: float, weight: bool = True) -> RowGroup:
    b = Builder([("x", FULL)] + ([("weight", COL)] if weight else []))
    return b.group(emit_rms_norm(b, ("input", 0), ("input", 1) if weight else None, columns, eps))


def layer_norm(columns: int, eps: float, affine: bool = True) -> RowGroup:
    b = Builder([("x", FULL)] + ([("weight", COL), ("bias", COL)] if affine else []))
    w, bias = (("input", 1), ("input", 2)) if affine else (None, None)
    return b.group(emit_layer_norm(b, ("input", 0), w, bias, columns, eps))


def softmax() -> RowGroup:
    b = Builder([("x", FULL)])
    return b.group(emit_softmax(b, ("input", 0)))


def log_softmax() -> RowGroup:
    b = Builder([("x", FULL)])
    return b.group(emit_log_softmax(b, ("input", 0)))


def emit_cross_entropy(b: Builder, x, target, cols, ignore_index: int):
    """Per row: -log_softmax(logits)[target], as eager's nll_loss of log_softmax, 0 where target
    == ignore_index; target a ROW input of integers, cols the INDEX input."""
    b.class_indices(target, ignore_index)
    picked = b("row_sum", b("where", b("eq", cols, target), b("log_softmax", x), 0.0))
    return b("mul", b("neg", picked), b("ne", target, float(ignore_index)))


def cross_entropy(ignore_index: int = -100) -> RowGroup:
    """Per-row losses; inputs: logits (FULL), target (ROW, integers), the column index (INDEX);
    the mean over the rows not ignored is the caller's (F.cross_entropy's reduction="mean")."""
    b = Builder([("logits", FULL), ("target", ROW), ("cols", INDEX)])
    return b.group(emit_cross_entropy(b, ("input", 0), ("input", 1), ("input", 2), ignore_index))
