"""Launching a row group's kernels (row_kernel.py writes them): what one launch derives from its
tensors' shapes, strides and dtypes.

RowForward and RowBackward hold it for one signature of the tensors (the rows, the outputs' and
gradient buffers' layouts, the kernel's text, grid and integer arguments, what is summed up
after): made once per input signature (runtime/fused_row.py keeps them), they then allocate and
name the pointers for each call. row_forward and row_backward make one and launch through
Triton's JITFunction (tests, the unbound path); RowFunction is a group as one autograd op.
A program takes tiles of RB rows by BLOCK columns, RB as many rows as fill a tile (TILE
elements: narrow rows go many to a program); layout() chooses the persistent or looped form.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .compile import load
from .row_group import COL, FULL, ROW, RowGroup, check_columns, check_row_inputs, remembered
from .row_kernel import LOOP_BLOCK, MAX_PERSISTENT, pointer_kinds, source
from .row_program import RowProgram, backward_program, forward_program
from .row_space import RowSpace, addressing, empty_like_order

# a tile is RB rows by BLOCK columns; how many elements one holds: a GPU program's registers,
# the interpreter's numpy arrays (its cost is per line, not per element)
TILE = {"cuda": 1 << 12, "interpreter": 1 << 16}


def _space(group: RowGroup, inputs, space: RowSpace | None, missing: bool = False):
    """The rows (by default over the leading dims of the first FULL input) and the inputs as the
    kernel reads them: a ROW input of one value per row but no col dims (a class index per row)
    viewed with them. ValueError when an input does not fit the rows."""
    check_row_inputs(group, inputs, missing)
    if space is None:
        full = [t for k, t in enumerate(inputs) if group.input_kind(k) == FULL]
        if not full or full[0].dim() == 0:
            raise ValueError("a row group needs a full input of at least one dim: the rows are its leading dims")
        space = RowSpace.last(full[0].shape)
    check_columns(group, space.columns)
    given = []
    for k, t in enumerate(inputs):
        if t is None:
            given.append(None)
            continue
        kind = group.input_kind(k)
        t = t.reshape(_view_shape(kind, tuple(t.shape), space))
        strides = space.strides(t)
        if (kind == ROW and any(strides[d] for d in space.col_dims if space.shape[d] > 1)) or \
                (kind == COL and any(strides[d] for d in space.row_dims if space.shape[d] > 1)):
            raise ValueError(f"input {k} ({kind}) has shape {tuple(t.shape)} for rows of {list(space.shape)}")
        given.append(t)
    return space, given


def _view_shape(kind: str, shape: tuple, space: RowSpace) -> tuple:
    """How the kernel views an input of this shape: a ROW value of another rank than the rows'
    whose sizes other than 1 are the row dims' (a class index per row, a batch norm's
    per-channel vector, NFNet's [C, 1, 1, 1] gain) with the col dims; a COL value so of the
    col dims', when they are not just the last (a layer norm's weight over channels), with the
    row dims; others as they are."""
    if kind == ROW and len(shape) != len(space.shape) and \
            [s for s in shape if s != 1] == [space.shape[d] for d in space.row_dims if space.shape[d] != 1]:
        return space.row_shape()
    if kind == COL and len(shape) != len(space.shape) and space.col_dims != (len(space.shape) - 1,) and \
            [s for s in shape if s != 1] == [space.shape[d] for d in space.col_dims if space.shape[d] != 1]:
        return space.col_shape()  # a norm's weight over channels that are not the last dim
    return shape


def layout(c: int, block: int | None = None) -> tuple[bool, int]:
    """(looped, BLOCK) for rows of c columns; `block` forces a chunk size (tests of the looped form)."""
    if block is not None and block < c:
        return True, block
    if c <= MAX_PERSISTENT:
        return False, max(16, 1 << (c - 1).bit_length())
    return True, LOOP_BLOCK


_KERNELS: dict = {}


def kernel(text: str, name: str):
    """The Triton kernel of this text, loaded once."""
    if text not in _KERNELS:
        _KERNELS[text] = getattr(load(text), name)
    return _KERNELS[text]


def programs(r: int, size: int, looped: bool, partial: bool, device: torch.device) -> tuple[int, int, int]:
    """(P programs, ROWS rows each, RB rows a tile) for r rows of tiles BLOCK=size wide: a tile per
    program, unless the program stores COL partial sums, which each program adds over a run of
    tiles (a few programs per multiprocessor on CUDA: P x C partial sums to add up, not R x C)."""
    tile = TILE["cuda" if device.type == "cuda" else "interpreter"]
    rb = min(1 << max((tile // size).bit_length() - 1, 0), 1 << max(r - 1, 0).bit_length())
    tiles = -(-r // rb)
    if looped or not partial or r == 0:
        return tiles, rb, rb
    slots = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    per = -(-tiles // min(tiles, slots))
    return -(-tiles // per), per * rb, rb


@dataclass(frozen=True)
class RowLaunch:
    """One launch of a row program: its kernel's text and name, the pointers it takes (names, in
    parameter order), the grid, the integer arguments after the pointers and the constexprs."""

    text: str
    name: str
    pointers: tuple
    grid: tuple
    scalars: tuple
    constexprs: tuple  # (name, value) pairs

    def kernel(self):
        return kernel(self.text, self.name)

    def __call__(self, tensors: dict) -> None:
        """Launch through Triton's JITFunction, the tensors by pointer name (an unbound launch)."""
        self.kernel()[self.grid](*[tensors[p] for p in self.pointers], *self.scalars, **dict(self.constexprs))


def row_launch(group: RowGroup, program: RowProgram, name: str, space: RowSpace, tensors: dict, grid: tuple,
               block: int | None) -> RowLaunch:
    """tensors: pointer name -> tensor (a partial-sum buffer is [P, C], without strides); grid:
    (P, ROWS, RB) from programs()."""
    looped, size = layout(space.columns, block)
    kinds = pointer_kinds(program)
    strided = [p for p in program.pointers if kinds[p] != "partial"]
    where = addressing(space, [tensors[p] for p in strided])
    text = remembered(group, (program, name, looped, where.dims),
                      lambda: source(group, program, name, looped, where.dims))
    args = [space.rows, space.columns, grid[1]] + list(where.row_sizes) + list(where.col_sizes)
    for p, row_strides, col_strides in zip(strided, where.row_strides, where.col_strides):
        args += list(row_strides) if kinds[p] in (FULL, ROW) else []
        args += list(col_strides) if kinds[p] in (FULL, COL) else []
    return RowLaunch(text, name, tuple(program.pointers), (grid[0],), tuple(args), (("BLOCK", size), ("RB", grid[2])))


def _reshaped(inputs, given) -> tuple:
    """The inputs whose view the kernel reads is a copy, not a view (made again at each call)."""
    return tuple(k for k, (t, g) in enumerate(zip(inputs, given))
                 if t is not None and g is not t and not g._is_view())


class RowForward:
    """The forward of a group on inputs of one signature: its rows, its outputs' layouts (FULL ones
    at the rows' shape, laid out in orders[i], outermost dim first, contiguous by default; ROW ones
    at the row shape) and its launch (None where no element is computed)."""

    def __init__(self, group: RowGroup, inputs, block: int | None = None, space: RowSpace | None = None,
                 orders: tuple = ()):
        self.group = group
        self.space, given = _space(group, inputs, space)
        self.reshaped = _reshaped(inputs, given)
        self.views = tuple(None if g is None else tuple(g.shape) for g in given)
        device = next(t.device for t in given if t is not None)
        self.outputs = tuple((self.space.shape, orders[i] if i < len(orders) else None, group.dtypes[j])
                             if group.step_kind(j) == FULL else (self.space.row_shape(), None, group.dtypes[j])
                             for i, j in enumerate(group.outputs))
        self.launch = None
        if self.space.rows and self.space.columns:
            program = forward_program(group)
            tensors = {f"x{k}": t for k, t in enumerate(given) if t is not None}
            tensors.update({f"out{i}": o for i, o in enumerate(self.allocate(torch.device("meta")))})
            looped, size = layout(self.space.columns, block)
            self.launch = row_launch(group, program, "row_forward", self.space, tensors,
                                     programs(self.space.rows, size, looped, False, device), block)
            pool = [f"x{k}" for k in range(len(inputs))] + [f"out{i}" for i in range(len(self.outputs))]
            self.places = tuple(pool.index(p) for p in self.launch.pointers)

    def allocate(self, device) -> list[torch.Tensor]:
        return [empty_like_order(shape, order, dtype, device) for shape, order, dtype in self.outputs]

    def layouts(self) -> tuple:
        """(shape, strides, dtype) of each output: what allocating one needs, worked out once."""
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            return tuple((tuple(t.shape), t.stride(), t.dtype) for t in self.allocate(torch.device("meta")))

    def pointers(self, inputs, outputs) -> list:
        """The launch's tensors: inputs as given (a view of one shares its data), then outputs."""
        if self.reshaped:
            inputs = [t.reshape(self.views[k]) if k in self.reshaped else t for k, t in enumerate(inputs)]
        pool = (*inputs, *outputs)
        return [pool[i] for i in self.places]


def row_forward(group: RowGroup, inputs, block: int | None = None, launch: bool = True,
                space: RowSpace | None = None, orders: tuple = ()) -> list[torch.Tensor]:
    """The outputs, each in its step's dtype (RowForward); with launch=False they are allocated and
    not computed (FakeTensors: what a run allocates)."""
    bound = RowForward(group, inputs, block, space, orders)
    device = next(t.device for t in inputs if t is not None)
    outs = bound.allocate(device)
    if launch and bound.launch is not None:
        bound.launch(dict(zip(bound.launch.pointers, bound.pointers(inputs, outs))))
    return outs


class RowBackward:
    """The backward of a group for one signature of inputs, incoming gradients and wanted
    gradients: its program, the gradient buffers (a shifted input's zeroed: it is stored only at
    the columns it was read from; a COL gradient's partial sums in fp32, cast to its input's dtype
    once added up) and its launch (None where nothing is computed). grads: per output whether it
    has an incoming gradient; loaded: the steps the caller kept, read instead of recomputed; an
    input the program does not read may be None, its shape given in shapes."""

    def __init__(self, group: RowGroup, inputs, grads, needs, block: int | None = None,
                 space: RowSpace | None = None, loaded: dict | None = None, shapes: list | None = None):
        loaded = loaded or {}
        self.group, self.needs = group, tuple(bool(n) for n in needs)
        self.space, given = _space(group, inputs, space, missing=True)
        self.reshaped = _reshaped(inputs, given)
        self.views = tuple(None if g is None else tuple(g.shape) for g in given)
        self.program = backward_program(group, [g is not None for g in grads], needs, frozenset(loaded))
        device = next(t.device for t in [*given, *grads, *loaded.values()] if t is not None)
        self.shapes = [None if group.is_index(k) else tuple(t.shape) if t is not None else tuple(shapes[k])
                       for k, t in enumerate(inputs)]
        looped, size = layout(self.space.columns, block)
        grid = programs(self.space.rows, size, looped, any(s.kind == COL for s in self.program.stores), device)
        sizes = {FULL: self.space.shape, ROW: self.space.row_shape(), COL: (grid[0], self.space.columns)}
        self.buffers = tuple((k, sizes[group.input_kind(k)], bool(group.inputs[k].shift),
                              torch.float32 if group.input_kind(k) == COL else group.inputs[k].dtype)
                             for k in self.program.grads)
        self.zeros = tuple((k, shape, inputs[k].dtype if inputs[k] is not None else group.inputs[k].dtype)
                           for k, shape in enumerate(self.shapes)
                           if needs[k] and k not in self.program.grads and shape is not None)
        self.launch, self._finishing = None, None
        if self.space.rows and self.space.columns and self.program.grads:
            tensors = {f"x{k}": t for k, t in enumerate(given) if t is not None}
            tensors.update({f"v{j}": t for j, t in loaded.items()})
            tensors.update({f"g{i}": g for i, g in enumerate(grads) if g is not None})
            tensors.update({f"d{k}": b for k, b in zip(self.program.grads, self.allocate(torch.device("meta")))})
            self.launch = row_launch(group, self.program, "row_backward", self.space, tensors, grid, block)
            # a call's pool of tensors: the inputs, the loaded steps in step order, the grads, the buffers
            self.steps = sorted(loaded)
            pool = ([f"x{k}" for k in range(len(inputs))] + [f"v{j}" for j in self.steps]
                    + [f"g{i}" for i in range(len(grads))] + [f"d{k}" for k in self.program.grads])
            self.places = tuple(pool.index(p) for p in self.launch.pointers)

    def allocate(self, device) -> list[torch.Tensor]:
        return [(torch.zeros if shifted else torch.empty)(size, device=device, dtype=dtype)
                for _, size, shifted, dtype in self.buffers]

    def pointers(self, inputs, loaded: dict, grads, buffers) -> list:
        if self.reshaped:
            inputs = [t.reshape(self.views[k]) if k in self.reshaped else t for k, t in enumerate(inputs)]
        pool = (*inputs, *[loaded[j] for j in self.steps], *grads, *buffers)
        return [pool[i] for i in self.places]

    def gradients(self, buffers, device) -> list[torch.Tensor | None]:
        """The inputs' gradients from the filled buffers (a COL one's partial sums added up), each
        summed to its input's shape; zeros for one wanted without a path to an output with a gradient."""
        out: list[torch.Tensor | None] = [None] * len(self.shapes)
        for (k, partial, summed, shaped), buffer in zip(self.finishing, buffers):
            if partial is not None:  # the programs' partial sums added up (in fp32), in the input's dtype
                buffer = buffer.sum(0).reshape(partial[0])
                if partial[1] != torch.float32:
                    buffer = buffer.to(partial[1])
            if summed is not None:
                buffer = buffer.sum_to_size(summed)
            out[k] = buffer if shaped is None else buffer.reshape(shaped)
        for k, shape, dtype in self.zeros:
            out[k] = torch.zeros(shape, device=device, dtype=dtype)
        return out

    @property
    def finishing(self) -> tuple:
        """Per buffer: (its input, (the shape, dtype) its partial sums are added up to (the col
        shape, or its view where that only drops 1s), the shape it is summed to, the shape it is
        given), None where nothing is to do."""
        if self._finishing is None:
            steps, space, group = [], self.space, self.group
            for k, size, _, _ in self.buffers:
                kind = group.input_kind(k)
                partial = (space.col_shape(), group.inputs[k].dtype) if kind == COL else None
                size = space.col_shape() if kind == COL else tuple(size)
                view = _view_shape(kind, self.shapes[k], space)
                shaped = None if view == self.shapes[k] else self.shapes[k]
                if partial is not None and math.prod(view) == math.prod(size):  # summing to it only drops 1s
                    partial, size = (view, partial[1]), view
                steps.append((k, partial, None if size == view else view, shaped))
            self._finishing = tuple(steps)
        return self._finishing


def row_backward(group: RowGroup, inputs, grads, needs, block: int | None = None, launch: bool = True,
                 space: RowSpace | None = None, loaded: dict | None = None,
                 shapes: list | None = None) -> list[torch.Tensor | None]:
    """grads: per output, its incoming gradient or None; needs: per input, whether it wants one;
    loaded: {step: its stored output}, read instead of recomputed where the caller kept it; an
    input the program does not read may then be None, its shape given in shapes (RowBackward)."""
    loaded = loaded or {}
    bound = RowBackward(group, inputs, grads, needs, block, space, loaded, shapes)
    device = next(t.device for t in [*inputs, *grads, *loaded.values()] if t is not None)
    buffers = bound.allocate(device)
    if launch and bound.launch is not None:
        bound.launch(dict(zip(bound.launch.pointers, bound.pointers(inputs, loaded, grads, buffers))))
    return bound.gradients(buffers, device)


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
