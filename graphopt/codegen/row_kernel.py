"""Triton kernels of a row group (row_group.py): each program takes a run of rows, its program
(row_program.py) laid out in one of two forms.

Persistent (the row fits one block, C <= MAX_PERSISTENT): a program loops over its ROWS rows, every
line once per row, straight down, the row's columns loaded once and kept in registers; a reduce
line reduces the block. A COL store (a weight's gradient) adds into a block-wide accumulator over
the program's rows, stored once at the end as the program's partial sum: the launcher sums P
partial rows, not R (Liger-Kernel's and Inductor's split of a norm's weight gradient).
Looped (wider rows): one row per program, in passes over chunks of BLOCK columns.
1. Each ROW name is known after some pass: a load or a line on known scalars after pass 0, a
   reduce line one pass after every ROW value its FULL expression depends on.
2. Pass p (1, 2, ...) walks the chunks, recomputing in each the FULL lines the reduce lines of
   pass p read (loads included) and adding them into one block-wide accumulator per reduce line
   (0 for sum, -inf for max), reduced to the row's value after the loop; then the ROW lines that
   become known.
3. A last walk over the chunks recomputes what the FULL and COL stores read and stores it (a COL
   store's partial sum is the row's own); ROW stores follow. A value is recomputed in each pass
   that needs it rather than kept: a row wider than a block does not fit in registers.
Either way a FULL or COL value is a block of columns (masked lanes hold whatever the templates
make of the 0 loaded there, kept out of every reduction and store), a ROW value a scalar;
pointers are at row * C + cols (FULL), cols (COL) or row (ROW), the launcher handing rows
contiguous.
"""
from __future__ import annotations

import math

import torch

from .compile import load
from .kernel import INDENT, module
from .row_group import COL, FULL, ROW, RowGroup, check_inputs
from .row_program import Line, RowProgram, backward_program, forward_program, vector

MAX_PERSISTENT = 1 << 14  # columns held in one block
LOOP_BLOCK = 1024  # columns per chunk in the looped form
AT = {FULL: "row * C + cols", COL: "cols", ROW: "row"}
PARTIAL = "pid * C + cols"  # where a program stores its partial sum of a COL store
NEUTRAL = {"sum": "0.0", "max": "float('-inf')"}


def _load(line: Line) -> str:
    kind = line.expr  # where it is read from
    where = "" if kind == ROW else ", mask=mask, other=0.0"
    return f"{line.target} = tl.load({line.target}_ptr + {AT[kind]}{where}).to(tl.float32)"


def _assign(line: Line, kinds: dict) -> str:
    if line.load:
        return _load(line)
    expr = line.expr
    if vector(line.kind) and not any(vector(kinds[r]) for r in line.reads):
        expr = f"tl.zeros([BLOCK], dtype=tl.float32) + ({expr})"  # a block, whatever it reads
    return f"{line.target} = {expr}" + (f"  # {line.comment}" if line.comment else "")


def _reduced(line: Line) -> str:
    op = "tl.sum" if line.reduce == "sum" else "tl.max"
    return f"{op}(tl.where(mask, {line.expr}, {NEUTRAL[line.reduce]}), axis=0)"


def _persistent(program: RowProgram) -> list[str]:
    kinds = {line.target: line.kind for line in program.lines}
    partial = [s for s in program.stores if s.kind == COL]
    head = ["cols = tl.arange(0, BLOCK)", "mask = cols < C"]
    head += [f"{s.value}_acc = tl.zeros([BLOCK], dtype=tl.float32)" for s in partial]
    body = []
    for line in program.lines:
        body.append(f"{line.target} = {_reduced(line)}  # {line.comment}" if line.reduce else _assign(line, kinds))
    body += [f"tl.store({s.pointer}_ptr + {AT[s.kind]}, {s.value}{'' if s.kind == ROW else ', mask=mask'})"
             for s in program.stores if s.kind != COL]
    body += [f"{s.value}_acc = {s.value}_acc + {s.value}" for s in partial]
    loop = ["for row in range(pid * ROWS, tl.minimum(pid * ROWS + ROWS, R)):"] + [INDENT + b for b in body]
    return head + loop + [f"tl.store({s.pointer}_ptr + {PARTIAL}, {s.value}_acc, mask=mask)" for s in partial]


def _known_after(program: RowProgram) -> dict[str, int]:
    """Step 1: the pass after which each name is known (for FULL and COL names: after which
    every ROW value they read is)."""
    after: dict[str, int] = {}
    for line in program.lines:
        needed = max((after[r] for r in line.reads), default=0)
        after[line.target] = needed + 1 if line.reduce else needed
    return after


def _closure(program: RowProgram, names) -> list[Line]:
    """The FULL and COL lines computing `names`, with what they read, in program order."""
    by_name = {line.target: line for line in program.lines}
    wanted, stack = set(), [n for n in names if vector(by_name[n].kind)]
    while stack:
        name = stack.pop()
        if name not in wanted:
            wanted.add(name)
            stack += [r for r in by_name[name].reads if vector(by_name[r].kind)]
    return [line for line in program.lines if line.target in wanted]


def _chunks(body: list[str]) -> list[str]:
    return (["for start in range(0, C, BLOCK):", INDENT + "cols = start + tl.arange(0, BLOCK)",
             INDENT + "mask = cols < C"] + [INDENT + b for b in body])


def _looped(program: RowProgram) -> list[str]:
    kinds = {line.target: line.kind for line in program.lines}
    after = _known_after(program)
    scalars = [line for line in program.lines if line.kind == ROW and not line.reduce]
    body = [_assign(line, kinds) for line in scalars if after[line.target] == 0]
    for p in range(1, max((after[line.target] for line in program.lines if line.reduce), default=0) + 1):
        reduces = [line for line in program.lines if line.reduce and after[line.target] == p]
        body.append(f"# pass {p}: {', '.join(line.target for line in reduces)}")
        body += [f"{line.target}_acc = tl.full([BLOCK], {NEUTRAL[line.reduce]}, tl.float32)" for line in reduces]
        inner = [_assign(line, kinds) for line in _closure(program, [r for line in reduces for r in line.reads])]
        for line in reduces:
            value = f"tl.where(mask, {line.expr}, {NEUTRAL[line.reduce]})"
            inner.append(f"{line.target}_acc = {line.target}_acc + {value}" if line.reduce == "sum"
                         else f"{line.target}_acc = tl.maximum({line.target}_acc, {value})")
        body += _chunks(inner)
        body += [f"{line.target} = {'tl.sum' if line.reduce == 'sum' else 'tl.max'}({line.target}_acc, axis=0)"
                 f"  # {line.comment}" for line in reduces]
        body += [_assign(line, kinds) for line in scalars if after[line.target] == p]
    full = [s for s in program.stores if s.kind != ROW]
    if full:
        inner = [_assign(line, kinds) for line in _closure(program, [s.value for s in full])]
        inner += [f"tl.store({s.pointer}_ptr + {AT[FULL]}, {s.value}, mask=mask)" for s in full]
        body += ["# the stores"] + _chunks(inner)
    return ["row = pid"] + body + [f"tl.store({s.pointer}_ptr + row, {s.value})" for s in program.stores if s.kind == ROW]


def source(group: RowGroup, program: RowProgram, name: str, looped: bool) -> str:
    title = f"# graphopt row {name.split('_')[1]} ({'looped' if looped else 'persistent'}): {group.describe()}"
    head = [title, "import triton", "import triton.language as tl", "", ""]
    signature = ["@triton.jit", f"def {name}({', '.join(p + '_ptr' for p in program.pointers)}, C, R, ROWS, "
                 "BLOCK: tl.constexpr):", INDENT + "pid = tl.program_id(0).to(tl.int64)"]
    body = _looped(program) if looped else _persistent(program)
    return module(head, signature + [INDENT + b for b in body])


# -- launching -------------------------------------------------------------------------------------


def _rows(group: RowGroup, inputs, values: bool = True) -> tuple[tuple, int, int]:
    """(the FULL inputs' shape, rows R, columns C), checking every input's shape against them
    (and with values=True, an integer input's values)."""
    check_inputs(group, inputs, values)
    full = [t for k, t in enumerate(inputs) if group.input_kind(k) == FULL]
    if not full:
        raise ValueError("a row group needs a full input: the rows are its leading dims")
    shape = tuple(full[0].shape)
    if not shape or any(tuple(t.shape) != shape for t in full):
        raise ValueError(f"the full inputs' shapes differ or are 0-dim: {[tuple(t.shape) for t in full]}")
    c, r = shape[-1], math.prod(shape[:-1])
    for k, t in enumerate(inputs):
        kind = group.input_kind(k)
        if t is not None and ((kind == COL and t.numel() != c) or (kind == ROW and t.numel() != r)):
            raise ValueError(f"input {k} ({kind}) has shape {tuple(t.shape)} for rows of {shape}")
    return shape, r, c


def layout(c: int, block: int | None = None) -> tuple[bool, int]:
    """(looped, BLOCK) for rows of c columns; `block` forces a chunk size (tests of the looped form)."""
    if block is not None and block < c:
        return True, block
    if c <= MAX_PERSISTENT:
        return False, max(16, 1 << (c - 1).bit_length())
    return True, LOOP_BLOCK


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1)


def _given(inputs) -> list[torch.Tensor]:
    """The tensors the kernel reads, in signature order (the column index is made, not read)."""
    return [_flat(t) for t in inputs if t is not None]


_KERNELS: dict = {}


def _kernel(text: str, name: str):
    if text not in _KERNELS:
        _KERNELS[text] = getattr(load(text), name)
    return _KERNELS[text]


def programs(r: int, looped: bool, partial: bool, device: torch.device) -> tuple[int, int]:
    """(P programs, ROWS rows each) for r rows: a row per program, unless the program stores COL
    partial sums, which each program adds over a run of rows (a few programs per multiprocessor
    on CUDA: P x C partial sums to add up rather than R x C)."""
    if looped or not partial or r == 0:
        return r, 1
    slots = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    rows = -(-r // min(r, slots))
    return -(-r // rows), rows


def row_forward(group: RowGroup, inputs, block: int | None = None, launch: bool = True) -> list[torch.Tensor]:
    """The outputs (FULL ones at the rows' shape, ROW ones with a last dim of 1), float32; with
    launch=False they are allocated and not computed (FakeTensors: what a run allocates)."""
    shape, r, c = _rows(group, inputs, launch)
    looped, size = layout(c, block)
    device = next(t.device for t in inputs if t is not None)
    outs = [torch.empty(shape if group.step_kind(j) == FULL else shape[:-1] + (1,), device=device,
                        dtype=torch.float32) for j in group.outputs]
    given = _given(inputs)  # contiguous copies of strided inputs: allocated with launch=False too
    if launch and r:
        kernel = _kernel(source(group, forward_program(group), "row_forward", looped), "row_forward")
        kernel[(r,)](*given, *outs, c, r, 1, BLOCK=size)
    return outs


def row_backward(group: RowGroup, inputs, grads, needs, block: int | None = None,
                 launch: bool = True) -> list[torch.Tensor | None]:
    """grads: per output, its incoming gradient or None; needs: per input, whether it wants one."""
    shape, r, c = _rows(group, inputs, launch)
    looped, size = layout(c, block)
    program = backward_program(group, [g is not None for g in grads], needs)
    device = next(t.device for t in inputs if t is not None)
    p, rows = programs(r, looped, any(s.kind == COL for s in program.stores), device)
    sizes = {FULL: shape, ROW: shape[:-1] + (1,), COL: (p, c)}
    buffers = [torch.empty(sizes[group.input_kind(k)], device=device, dtype=torch.float32) for k in program.grads]
    given = _given(inputs) + [_flat(g) for g in grads if g is not None]  # as in forward
    if launch and r and program.grads:
        kernel = _kernel(source(group, program, "row_backward", looped), "row_backward")
        kernel[(p,)](*given, *buffers, c, r, rows, BLOCK=size)
    out: list[torch.Tensor | None] = [None] * len(inputs)
    for k, buffer in zip(program.grads, buffers):
        grad = buffer.sum(0) if group.input_kind(k) == COL else buffer  # the programs' partial sums added up
        out[k] = grad.reshape(inputs[k].shape)
    for k, t in enumerate(inputs):
        if needs[k] and out[k] is None and t is not None:  # no path from it to an output with a gradient
            out[k] = torch.zeros_like(t)
    return out


class RowFunction(torch.autograd.Function):
    """A row group as one autograd op: its forward and backward kernels."""

    @staticmethod
    def forward(ctx, group: RowGroup, block, *inputs):
        ctx.group, ctx.block = group, block
        ctx.save_for_backward(*inputs)
        outs = row_forward(group, inputs, block)
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[2:]
        return (None, None, *row_backward(ctx.group, ctx.saved_tensors, list(grads), needs, ctx.block))


def row_call(group: RowGroup, *inputs, block: int | None = None):
    """The group on `inputs`, differentiable; `block` forces the looped form's chunk size."""
    return RowFunction.apply(group, block, *inputs)
