"""Running a fused row group (codegen/row_group.py): a norm, softmax or reduction over the last dim
with the elementwise ops around it, as one autograd op.

1. FusedRowOp(group)(*inputs) applies an autograd.Function whose forward runs the group and saves
   only its inputs (eager's norm saves its input and per-row statistics, its softmax its output,
   the elementwise ops around them what they read); its backward recomputes the row in the
   backward kernel, which also forms the column reductions a weight's gradient needs.
2. Where it runs, as fused.py's groups: CUDA tensors and, under TRITON_INTERPRET=1, CPU tensors run
   the row kernels (row_kernel.py); other CPU tensors run the group's steps as torch ops on the
   rows (row_reference), the backward recomputing them under autograd. FakeTensors allocate what a
   run allocates and launch nothing.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ..codegen.group import Step
from ..codegen.program import forward_expr, name
from ..codegen.row_group import FULL, ROW, RowGroup
from ..codegen.row_kernel import row_backward, row_forward
from ..ops.shim import tl
from .fused import STATS, _device, _inside, _runs_kernel, _shape_only


def row_reference(group: RowGroup, inputs) -> list[torch.Tensor]:
    """The group's outputs computed by torch ops over rows: FULL values as [R, C], ROW as [R, 1],
    COL as [C]; differentiable, so autograd gives the reference gradients."""
    full = next(t.shape for k, t in enumerate(inputs) if group.input_kind(k) == FULL)
    c = full[-1]
    scope = {"tl": tl}
    for k, t in enumerate(inputs):
        kind = group.input_kind(k)
        t = t.to(torch.float32)
        scope[f"x{k}"] = t.reshape(-1, c) if kind == FULL else t.reshape(-1, 1) if kind == ROW else t.reshape(c)
    for j, step in enumerate(group.steps):
        if isinstance(step, Step):
            value = eval(forward_expr(step, torch.float32), scope)
        else:
            arg = scope[name(step.arg)]
            value = arg.sum(-1, keepdim=True) if step.kind == "sum" else arg.amax(-1, keepdim=True)
        scope[f"v{j}"] = torch.as_tensor(value)
    rows = math.prod(full[:-1])
    return [scope[f"v{j}"].broadcast_to((rows, c) if group.step_kind(j) == FULL else (rows, 1))
            .reshape(full if group.step_kind(j) == FULL else full[:-1] + (1,)) for j in group.outputs]


class _RowFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, *inputs):
        ctx.set_materialize_grads(False)  # a missing output gradient stays None: the kernel skips it
        ctx.op = op
        outputs = op.forward(inputs)
        ctx.save_for_backward(*inputs)
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return (None, *ctx.op.backward(ctx.saved_tensors, grads, ctx.needs_input_grad[1:]))


class FusedRowOp:
    """A fused row group as a callable: one tensor for a one-output group, else a tuple in
    group.outputs order. It has a __name__, so an FX call_function node can target it."""

    def __init__(self, group: RowGroup):
        self.group = group
        self.__name__ = self.__qualname__ = "fused_row_" + group.describe().replace(" -> ", "_")[:80]

    def __getstate__(self):
        return {"group": self.group}

    def __setstate__(self, state):
        self.__init__(state["group"])

    def __repr__(self) -> str:
        return f"FusedRowOp({self.group.describe()})"

    def __call__(self, *inputs):
        if len(inputs) != len(self.group.inputs):
            raise TypeError(f"{self.__name__} takes {len(self.group.inputs)} tensors, got {len(inputs)}")
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            outputs = _RowFunction.apply(self, *inputs)
        else:
            outputs = tuple(self.forward(inputs))
        return outputs[0] if len(outputs) == 1 else outputs

    def forward(self, inputs) -> list[torch.Tensor]:
        fake, device = _shape_only(inputs), _device(inputs)
        with _inside():
            STATS["launches"] += not fake
            if fake or _runs_kernel(device):
                return row_forward(self.group, inputs, launch=not fake)
            with torch.no_grad():
                return [v.contiguous() for v in row_reference(self.group, inputs)]

    def backward(self, inputs, grads, needs) -> list[torch.Tensor | None]:
        if all(g is None for g in grads):
            return [None] * len(inputs)
        fake, device = _shape_only(list(inputs) + [g for g in grads if g is not None]), _device(inputs)
        with _inside():
            STATS["launches"] += not fake
            if fake or _runs_kernel(device):
                return row_backward(self.group, inputs, grads, needs, launch=not fake)
            wanted = [t.detach().requires_grad_(need) for t, need in zip(inputs, needs)]
            with torch.enable_grad():
                outs = row_reference(self.group, wanted)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
            found = torch.autograd.grad([o for o, _ in pairs], [t for t, n in zip(wanted, needs) if n],
                                        [g for _, g in pairs], allow_unused=True)
            found = iter(found)
            result = []
            for t, need in zip(inputs, needs):
                g = next(found) if need else None
                result.append(torch.zeros_like(t) if need and g is None else g)
            return result
