"""Triton kernels of a row group (row_group.py): each program takes tiles of RB rows by BLOCK
columns, its program (row_program.py) laid out in one of two forms. A FULL value is an
[RB, BLOCK] tile, a ROW value [RB, 1], a COL value [1, BLOCK]; a reduce line reduces along the
columns. RB is as many rows as fill a tile (row_launch.TILE elements: narrow rows go many to a program).

Persistent (the row fits one block, C <= MAX_PERSISTENT): a program loops over its ROWS rows a
tile at a time, every line once per tile, straight down, the rows' columns loaded once and kept
in registers. A COL store (a weight's gradient) adds its tile's column sums into an accumulator
over the program's rows, stored once at the end as the program's partial sum: the launcher sums
P partial rows, not R (Liger-Kernel's and Inductor's split of a norm's weight gradient).
Looped (wider rows): one tile of rows per program, in passes over chunks of BLOCK columns.
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
make of the 0 loaded there, kept out of every reduction and store), as are rows past R. A
tensor's element (row, col) is at its row offset plus its col offset (row_space.py): the row
index is unravelled over the row dims once per row, the col index over the col dims once per
block, and each is dotted with the tensor's strides, so tensors are read and written where
eager keeps them (a transposed query, a mask broadcast over heads) without copies. A partial
sum is at pid * C + col.
"""
from __future__ import annotations

import torch

from .kernel import INDENT, TL, module
from .row_group import COL, FULL, ROW, RowGroup
from .row_program import Line, RowProgram, vector

CLASS_MESSAGE = "graphopt: a class index of a cross entropy is out of range: not in [0, classes) nor ignore_index"
MAX_PERSISTENT = 1 << 14  # columns held in one block
LOOP_BLOCK = 1024  # columns per chunk in the looped form
PARTIAL = "pid * C + cols"  # where a program stores its partial sum of a COL store
NEUTRAL = {"sum": "0.0", "max": "float('-inf')"}


def _at(pointer: str, kind: str) -> str:
    return {FULL: f"{pointer}_row + {pointer}_col", ROW: f"{pointer}_row", COL: f"{pointer}_col"}[kind]


def _mask(pointer: str, kind: str, shifts: dict) -> str:
    mask = {FULL: "mask", ROW: "rmask", COL: "cmask"}[kind]
    if shifts.get(pointer):
        mask += f" & (cols + {shifts[pointer]} >= 0) & (cols + {shifts[pointer]} < C)"
    return mask


def _load(line: Line, shifts: dict, checks: dict) -> str:
    kind = line.expr  # where it is read from
    text = (f"{line.target} = tl.load({line.target}_ptr + {_at(line.target, kind)}, "
            f"mask={_mask(line.target, kind, shifts)}, other=0.0).to(tl.float32)")
    if line.target in checks:  # class indices: each a column or the ignored value (masked lanes load 0)
        value = line.target
        text += (f"; tl.device_assert(((({value} >= 0) & ({value} < C)) | ({value} == {float(checks[value])})), "
                 f"\"{CLASS_MESSAGE}\")")
    return text


def _store(pointer: str, kind: str, value: str, shifts: dict, dtype: torch.dtype = torch.float32) -> str:
    if dtype == torch.bfloat16:  # round_bf16 first: under the interpreter the cast alone truncates (kernel.py)
        value = f"round_bf16({value}).to(tl.bfloat16)"
    elif dtype != torch.float32:
        value = f"{value}.to({TL[dtype]})"
    return f"tl.store({pointer}_ptr + {_at(pointer, kind)}, {value}, mask={_mask(pointer, kind, shifts)})"


def pointer_shifts(group: RowGroup, program: RowProgram) -> dict[str, int]:
    """The column shift of each pointer that reads a shifted input, or stores its gradient."""
    shifts = {}
    for k, i in enumerate(group.inputs):
        if i.shift:
            shifts[f"x{k}"] = shifts[f"d{k}"] = i.shift
    return {p: shifts[p] for p in program.pointers if p in shifts}


def pointer_kinds(program: RowProgram) -> dict[str, str]:
    """Each pointer's class: where its tensor is read or written; "partial" for a COL store's
    partial sums (at pid * C + col, no strides)."""
    kinds = {line.target: line.expr for line in program.lines if line.load}
    kinds.update({s.pointer: "partial" if s.kind == COL else s.kind for s in program.stores})
    return {p: kinds[p] for p in program.pointers}


def _unravel(index: str, sizes: str, n: int, name: str) -> list[str]:
    """Lines giving {name}0..{name}{n-1}, the index's coordinates over n dims (sizes {sizes}0..)."""
    if n == 1:
        return [f"{name}0 = {index}"]
    lines, rest = [], index
    for d in range(n - 1, 0, -1):
        lines.append(f"{name}{d} = {rest} % {sizes}{d}")
        lines.append(f"{name}_rest{d} = {rest} // {sizes}{d}")
        rest = f"{name}_rest{d}"
    return lines + [f"{name}0 = {rest}"]


def _offsets(kinds: dict, which: str, n: int, shifts: dict) -> list[str]:
    """Each pointer's row (which="row") or col offset from the unravelled coordinates; a shifted
    pointer's col offset is that of column j + shift (rows over one col dim only)."""
    index = "i" if which == "row" else "j"
    wanted = (FULL, ROW) if which == "row" else (FULL, COL)
    lines = []
    for p, kind in kinds.items():
        if kind not in wanted:
            continue
        if which == "col" and shifts.get(p):
            lines.append(f"{p}_col = (j0 + {shifts[p]}) * {p}_cs0")
        else:
            lines.append(f"{p}_{which} = " + " + ".join(f"{index}{d} * {p}_{which[0]}s{d}" for d in range(n)))
    return lines


SHAPE = {FULL: "[RB, BLOCK]", ROW: "[RB, 1]", COL: "[1, BLOCK]"}


def _assign(line: Line, kinds: dict, shifts: dict, checks: dict) -> str:
    if line.load:
        return _load(line, shifts, checks)
    expr = line.expr
    if not any(kinds[r] in (FULL, line.kind) for r in line.reads):
        expr = f"tl.zeros({SHAPE[line.kind]}, dtype=tl.float32) + ({expr})"  # its tile, whatever it reads
    return f"{line.target} = {expr}" + (f"  # {line.comment}" if line.comment else "")


def _reduced(line: Line) -> str:
    op = "tl.sum" if line.reduce == "sum" else "tl.max"
    return f"{op}(tl.where(mask, {line.expr}, {NEUTRAL[line.reduce]}), axis=1)[:, None]"


def _columns(start: str, dims: tuple[int, int], pointers: dict, shifts: dict) -> list[str]:
    head = [f"cols = {start}tl.arange(0, BLOCK)[None, :]", "cmask = cols < C", "mask = rmask & cmask"]
    return head + _unravel("cols", "CS", dims[1], "j") + _offsets(pointers, "col", dims[1], shifts)


def _tile_rows(dims: tuple[int, int], pointers: dict, shifts: dict) -> list[str]:
    """The tile's rows (first .. first + RB), their mask, coordinates and offsets."""
    head = ["row = first + tl.arange(0, RB)[:, None]", "rmask = row < R"]
    return head + _unravel("row", "RS", dims[0], "i") + _offsets(pointers, "row", dims[0], shifts)


def _partial_sum(s) -> str:
    return f"tl.sum(tl.where(mask, {s.value}, 0.0), axis=0)[None, :]"


def _persistent(program: RowProgram, dims: tuple[int, int], shifts: dict, checks: dict) -> list[str]:
    kinds, pointers = {line.target: line.kind for line in program.lines}, pointer_kinds(program)
    partial = [s for s in program.stores if s.kind == COL]
    head = [f"{s.value}_acc = tl.zeros([1, BLOCK], dtype=tl.float32)" for s in partial]
    body = _tile_rows(dims, pointers, shifts) + _columns("", dims, pointers, shifts)
    for line in program.lines:
        body.append(f"{line.target} = {_reduced(line)}  # {line.comment}" if line.reduce
                    else _assign(line, kinds, shifts, checks))
    body += [_store(s.pointer, s.kind, s.value, shifts, s.dtype) for s in program.stores if s.kind != COL]
    body += [f"{s.value}_acc = {s.value}_acc + {_partial_sum(s)}" for s in partial]
    loop = ["for first in range(pid * ROWS, tl.minimum(pid * ROWS + ROWS, R), RB):"] + [INDENT + b for b in body]
    tail = [f"cols = tl.arange(0, BLOCK)[None, :]"] if partial else []
    tail += [f"tl.store({s.pointer}_ptr + {PARTIAL}, {s.value}_acc, mask=cols < C)" for s in partial]
    return head + loop + tail


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


def _chunks(body: list[str], dims: tuple[int, int], pointers: dict, shifts: dict) -> list[str]:
    return ["for start in range(0, C, BLOCK):"] + [INDENT + b for b in _columns("start + ", dims, pointers, shifts) + body]


def _looped(program: RowProgram, dims: tuple[int, int], shifts: dict, checks: dict) -> list[str]:
    kinds, pointers = {line.target: line.kind for line in program.lines}, pointer_kinds(program)
    after = _known_after(program)
    scalars = [line for line in program.lines if line.kind == ROW and not line.reduce]
    body = [_assign(line, kinds, shifts, checks) for line in scalars if after[line.target] == 0]
    for p in range(1, max((after[line.target] for line in program.lines if line.reduce), default=0) + 1):
        reduces = [line for line in program.lines if line.reduce and after[line.target] == p]
        body.append(f"# pass {p}: {', '.join(line.target for line in reduces)}")
        body += [f"{line.target}_acc = tl.full([RB, BLOCK], {NEUTRAL[line.reduce]}, tl.float32)" for line in reduces]
        read = [r for line in reduces for r in line.reads]
        inner = [_assign(line, kinds, shifts, checks) for line in _closure(program, read)]
        for line in reduces:
            value = f"tl.where(mask, {line.expr}, {NEUTRAL[line.reduce]})"
            inner.append(f"{line.target}_acc = {line.target}_acc + {value}" if line.reduce == "sum"
                         else f"{line.target}_acc = tl.maximum({line.target}_acc, {value})")
        body += _chunks(inner, dims, pointers, shifts)
        body += [f"{line.target} = {'tl.sum' if line.reduce == 'sum' else 'tl.max'}({line.target}_acc, axis=1)[:, None]"
                 f"  # {line.comment}" for line in reduces]
        body += [_assign(line, kinds, shifts, checks) for line in scalars if after[line.target] == p]
    full = [s for s in program.stores if s.kind != ROW]
    if full:
        inner = [_assign(line, kinds, shifts, checks) for line in _closure(program, [s.value for s in full])]
        inner += [f"tl.store({s.pointer}_ptr + {PARTIAL}, {_partial_sum(s)}, mask=cmask)" if s.kind == COL
                  else _store(s.pointer, FULL, s.value, shifts, s.dtype) for s in full]
        body += ["# the stores"] + _chunks(inner, dims, pointers, shifts)
    rows = ["first = pid * RB"] + _tile_rows(dims, pointers, shifts)
    return rows + body + [_store(s.pointer, ROW, s.value, shifts, s.dtype) for s in program.stores if s.kind == ROW]


def source(group: RowGroup, program: RowProgram, name: str, looped: bool, dims: tuple[int, int] = (1, 1)) -> str:
    """The kernel's text for rows unravelled over dims[0] dims and columns over dims[1]."""
    title = f"# graphopt row {name.split('_')[1]} ({'looped' if looped else 'persistent'}): {group.describe()}"
    head = [title, "import triton", "import triton.language as tl", "", ""]
    strided = list(pointer_kinds(program).items())
    params = [p + "_ptr" for p in program.pointers] + ["R", "C", "ROWS"]
    params += [f"RS{d}" for d in range(dims[0])] + [f"CS{d}" for d in range(dims[1])]
    for p, kind in strided:
        if kind in (FULL, ROW):
            params += [f"{p}_rs{d}" for d in range(dims[0])]
        if kind in (FULL, COL):
            params += [f"{p}_cs{d}" for d in range(dims[1])]
    signature = ["@triton.jit", f"def {name}({', '.join(params)}, BLOCK: tl.constexpr, RB: tl.constexpr):",
                 INDENT + "pid = tl.program_id(0).to(tl.int64)"]
    shifts = pointer_shifts(group, program)
    if shifts and dims[1] != 1:
        raise ValueError("a shifted input needs rows over one col dim")
    # the forward checks the class indices it reads (as eager's nll_loss does on CUDA): on the device, with
    # no sync; Triton compiles device assertions into a kernel only in its debug mode
    checks = class_checks(group) if name == "row_forward" else {}
    if checks:
        signature[0] = "@triton.jit(debug=True)"
    body = _looped(program, dims, shifts, checks) if looped else _persistent(program, dims, shifts, checks)
    return module(head, signature + [INDENT + b for b in body])


def class_checks(group: RowGroup) -> dict[str, int]:
    """Each class-index input's pointer, and the value it may hold besides a column (ignore_index)."""
    return {f"x{k}": i.ignore for k, i in enumerate(group.inputs) if i.ignore is not None}
