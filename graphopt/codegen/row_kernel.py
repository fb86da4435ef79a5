"""Triton kernels of a row group (row_group.py): one program per row, the row in one block.

Persistent form: the row's C columns fit one block (BLOCK = the next power of two, at most
MAX_COLUMNS), loaded once, every step computed in registers; a FULL or COL value is a block, a
ROW value a scalar. Wider rows need the looped form (not built yet: Unsupported).

Forward:
1. Loads: a FULL input at row * C + cols (the launcher hands rows contiguous), a COL input at
   cols, a ROW input at row; masked lanes read 0.
2. One line per step: an elementwise op's registry template over fp32 values (program.py); a
   reduction over the unmasked lanes (masked lanes hold whatever the templates made of 0).
3. A store per output: FULL at row * C + cols, ROW at row.
Backward (reverse mode over the steps, the forward recomputed in place of saved intermediates):
1. The forward's loads and steps.
2. Each output's incoming gradient seeds its step's adjoint.
3. Steps in reverse, each derivative template a contribution to its arg's adjoint, shaped to the
   arg's class: a FULL step's term into a ROW value is summed over the row; a reduction's term
   into its FULL arg is broadcast (sum) or shared among the elements equal to the maximum (max).
4. Stores: a FULL input's gradient at row * C + cols, a ROW input's at row; a COL input's per-row
   terms into an fp32 [R, C] buffer that the launcher sums over the rows (a column reduction).
"""
from __future__ import annotations

import math

import torch

from ..ops.templates import render
from .compile import load
from .group import Unsupported, is_ref, op_info
from .kernel import INDENT, module
from .program import forward_expr, operand_values
from .row_group import COL, FULL, ROW, Reduce, RowGroup, check_dtypes

MAX_COLUMNS = 1 << 14
VECTOR = "tl.zeros([BLOCK], dtype=tl.float32) + "


def _name(ref) -> str:
    return f"{'x' if ref[0] == 'input' else 'v'}{ref[1]}"


def _signature(name: str, pointers: list[str]) -> list[str]:
    return ["@triton.jit", f"def {name}({', '.join(p + '_ptr' for p in pointers)}, C, BLOCK: tl.constexpr):",
            INDENT + "row = tl.program_id(0).to(tl.int64)",
            INDENT + "cols = tl.arange(0, BLOCK)",
            INDENT + "mask = cols < C"]


def _at(kind: str) -> str:
    return {FULL: "row * C + cols", COL: "cols", ROW: "row"}[kind]


def _load(name: str, kind: str, masked: str = "mask") -> str:
    where = f", mask={masked}, other=0.0" if kind != ROW else ""
    return f"{name} = tl.load({name}_ptr + {_at(kind)}{where}).to(tl.float32)"


def _store(name: str, kind: str, value: str) -> str:
    return f"tl.store({name}_ptr + {_at(kind)}, {value}{', mask=mask' if kind != ROW else ''})"


def _forward_lines(group: RowGroup) -> list[str]:
    lines = [_load(f"x{k}", group.input_kind(k)) for k in range(len(group.inputs))]
    for j, s in enumerate(group.steps):
        if isinstance(s, Reduce):
            a = _name(s.arg)
            expr = (f"tl.sum(tl.where(mask, {a}, 0.0), axis=0)" if s.kind == "sum"
                    else f"tl.max(tl.where(mask, {a}, float('-inf')), axis=0)")
            lines.append(f"v{j} = {expr}  # row_{s.kind}")
        else:
            lines.append(f"v{j} = {forward_expr(s, torch.float32)}  # {s.op}")
    return lines


def forward_source(group: RowGroup) -> str:
    pointers = [f"x{k}" for k in range(len(group.inputs))] + [f"out{i}" for i in range(len(group.outputs))]
    body = _forward_lines(group)
    body += [_store(f"out{i}", group.step_kind(j), f"v{j}") for i, j in enumerate(group.outputs)]
    head = [f"# graphopt row forward: {group.describe()}", "import triton", "import triton.language as tl", "", ""]
    return module(head, _signature("row_forward", pointers) + [INDENT + b for b in body])


def _contributions(group: RowGroup, j: int) -> list[tuple[tuple, str]]:
    """(arg ref, term shaped to the arg's class) for each arg of step j a gradient flows into."""
    s, kind = group.steps[j], group.step_kind(j)
    if isinstance(s, Reduce):
        if s.kind == "sum":
            return [(s.arg, f"{VECTOR}a{j}")]
        eq = f"tl.where(mask & ({_name(s.arg)} == v{j}), 1.0, 0.0)"
        return [(s.arg, f"a{j} * {eq} / tl.sum({eq}, axis=0)")]
    op, out = op_info(s.op), []
    for i, a in enumerate(s.args):
        if not is_ref(a) or op.derivatives[i] is None:
            continue
        term = render(op.derivatives[i], g=f"a{j}", out=f"v{j}", **operand_values(s))
        target = group.ref_kind(a)
        if kind == FULL and target == ROW:
            term = f"tl.sum(tl.where(mask, {term}, 0.0), axis=0)"
        elif target != ROW:
            term = f"{VECTOR}({term})"  # a block, whatever the template's operands are
        out.append((a, term))
    return out


def backward_source(group: RowGroup, has_grad, needs) -> tuple[str, tuple[int, ...]]:
    """The backward kernel and the inputs it stores a gradient for."""
    body = _forward_lines(group)
    assigned = set()
    seeded = [i for i, g in enumerate(has_grad) if g]
    for i in seeded:
        j = group.outputs[i]
        body.append(_load(f"g{i}", group.step_kind(j)))
        body.append(f"a{j} = g{i}")
        assigned.add(f"a{j}")
    for j in reversed(range(len(group.steps))):
        if f"a{j}" not in assigned:
            continue
        for a, term in _contributions(group, j):
            target = f"{'d' if a[0] == 'input' else 'a'}{a[1]}"
            body.append(f"{target} = {term if target not in assigned else f'{target} + {term}'}"
                        f"  # d step {j} / d {_name(a)}")
            assigned.add(target)
    stored = tuple(k for k in range(len(group.inputs)) if needs[k] and f"d{k}" in assigned)
    # a COL input's gradient is stored per row, as a FULL one: the launcher sums the rows
    body += [_store(f"d{k}", ROW if group.input_kind(k) == ROW else FULL, f"d{k}") for k in stored]
    pointers = ([f"x{k}" for k in range(len(group.inputs))] + [f"g{i}" for i in seeded]
                + [f"d{k}" for k in stored])
    head = [f"# graphopt row backward: gradients of inputs {list(stored)} of {group.describe()}",
            "import triton", "import triton.language as tl", "", ""]
    return module(head, _signature("row_backward", pointers) + [INDENT + b for b in body]), stored


# -- launching -------------------------------------------------------------------------------------


def _rows(group: RowGroup, inputs) -> tuple[tuple, int, int]:
    """(the FULL inputs' shape, rows R, columns C), checking every input's shape against them."""
    check_dtypes(group, inputs)
    full = [t for k, t in enumerate(inputs) if group.input_kind(k) == FULL]
    if not full:
        raise ValueError("a row group needs a full input: the rows are its leading dims")
    shape = tuple(full[0].shape)
    if not shape or any(tuple(t.shape) != shape for t in full):
        raise ValueError(f"the full inputs' shapes differ or are 0-dim: {[tuple(t.shape) for t in full]}")
    c = shape[-1]
    r = math.prod(shape[:-1])
    for k, t in enumerate(inputs):
        kind = group.input_kind(k)
        if (kind == COL and t.numel() != c) or (kind == ROW and t.numel() != r):
            raise ValueError(f"input {k} ({kind}) has shape {tuple(t.shape)} for rows of {shape}")
    if c > MAX_COLUMNS:
        raise Unsupported(f"rows of {c} columns: the persistent form holds at most {MAX_COLUMNS} (looped form not built)")
    return shape, r, c


def _block(c: int) -> int:
    return max(16, 1 << (c - 1).bit_length())


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1)


_KERNELS: dict = {}


def _kernel(source: str, name: str):
    if source not in _KERNELS:
        _KERNELS[source] = getattr(load(source), name)
    return _KERNELS[source]


def row_forward(group: RowGroup, inputs) -> list[torch.Tensor]:
    shape, r, c = _rows(group, inputs)
    outs = [torch.empty(shape if group.step_kind(j) == FULL else shape[:-1] + (1,), device=inputs[0].device,
                        dtype=torch.float32) for j in group.outputs]
    kernel = _kernel(forward_source(group), "row_forward")
    kernel[(r,)](*map(_flat, inputs), *outs, c, BLOCK=_block(c))
    return outs


def row_backward(group: RowGroup, inputs, grads, needs) -> list[torch.Tensor | None]:
    """grads: per output, its incoming gradient or None; needs: per input, whether it wants one."""
    shape, r, c = _rows(group, inputs)
    source, stored = backward_source(group, [g is not None for g in grads], needs)
    device = inputs[0].device
    buffers = [torch.empty(shape if group.input_kind(k) != ROW else shape[:-1] + (1,), device=device,
                           dtype=torch.float32) for k in stored]
    kernel = _kernel(source, "row_backward")
    kernel[(r,)](*map(_flat, inputs), *(_flat(g) for g in grads if g is not None), *buffers, c, BLOCK=_block(c))
    out: list[torch.Tensor | None] = [None] * len(inputs)
    for k, buffer in zip(stored, buffers):
        grad = buffer.reshape(-1, c).sum(0) if group.input_kind(k) == COL else buffer
        out[k] = grad.reshape(inputs[k].shape)
    for k, t in enumerate(inputs):
        if needs[k] and out[k] is None:  # no path from it to an output with a gradient
            out[k] = torch.zeros_like(t)
    return out


class RowFunction(torch.autograd.Function):
    """A row group as one autograd op: its forward and backward kernels."""

    @staticmethod
    def forward(ctx, group: RowGroup, *inputs):
        ctx.group = group
        ctx.save_for_backward(*inputs)
        outs = row_forward(group, inputs)
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]
        return (None, *row_backward(ctx.group, inputs, list(grads), needs))


def row_call(group: RowGroup, *inputs):
    return RowFunction.apply(group, *inputs)
