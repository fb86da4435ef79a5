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
from .fused import STATS, _device, _inside, _runs_kernel, _shape_only, release_interpreted_arguments


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
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return (None, *ctx.op.backward(ctx.saved_tensors, grads, ctx.needs_input_grad[1:]))


class FusedRowOp:
    """A fused row group as a callable: one tensor for a one-output group, else a tuple in
    group.outputs order. It has a __name__, so an FX call_function node can target it.

    It takes the group's inputs but its column index (the kernel makes that one). finish, per
    output, turns its rows into the node's value: None (as they are), or a cross entropy's
    reduction of its rows' losses, ("mean" | "sum" | "none", the class indices' input, ignore_index)."""

    def __init__(self, group: RowGroup, finish: tuple = ()):
        self.group, self.finish = group, tuple(finish) or (None,) * len(group.outputs)
        self.given = [k for k in range(len(group.inputs)) if not group.is_index(k)]
        self.__name__ = self.__qualname__ = "fused_row_" + group.describe().replace(" -> ", "_")[:80]

    def __getstate__(self):
        return {"group": self.group, "finish": self.finish}

    def __setstate__(self, state):
        self.__init__(state["group"], state["finish"])

    def __repr__(self) -> str:
        return f"FusedRowOp({self.group.describe()})"

    def __call__(self, *inputs):
        if len(inputs) != len(self.given):
            raise TypeError(f"{self.__name__} takes {len(self.given)} tensors, got {len(inputs)}")
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            outputs = _RowFunction.apply(self, *inputs)
        else:
            outputs = tuple(self.forward(inputs))
        return outputs[0] if len(outputs) == 1 else outputs

    def _all(self, inputs) -> list:
        """The group's inputs: the given ones, None for the column index."""
        full = [None] * len(self.group.inputs)
        for k, t in zip(self.given, inputs):
            full[k] = t
        return full

    def forward(self, inputs) -> list[torch.Tensor]:
        fake, device = _shape_only(inputs), _device(inputs)
        everything = self._all(inputs)
        if not fake:
            self._check_classes(everything)
        with _inside():
            STATS["launches"] += not fake
            if fake or _runs_kernel(device):
                rows = row_forward(self.group, everything, launch=not fake)
                release_interpreted_arguments()
            else:
                with torch.no_grad():
                    rows = [v.contiguous() for v in row_reference(self.group, everything)]
            return [self._finished(o, f, everything) for o, f in zip(rows, self.finish)]

    def backward(self, inputs, grads, needs) -> list[torch.Tensor | None]:
        if all(g is None for g in grads):
            return [None] * len(inputs)
        fake, device = _shape_only(list(inputs) + [g for g in grads if g is not None]), _device(inputs)
        everything = self._all(inputs)
        grads = [None if g is None else self._rows_of(g, f, everything) for g, f in zip(grads, self.finish)]
        wants = self._all(needs)
        with _inside():
            STATS["launches"] += not fake
            if fake or _runs_kernel(device):
                result = row_backward(self.group, everything, grads, [bool(w) for w in wants], launch=not fake)
                release_interpreted_arguments()
            else:
                result = self._reference_backward(everything, grads, [bool(w) for w in wants])
        return [result[k] for k in self.given]

    def _reference_backward(self, inputs, grads, needs):
        wanted = [None if t is None else t.detach().requires_grad_(need) for t, need in zip(inputs, needs)]
        with torch.enable_grad():
            outs = row_reference(self.group, wanted)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        found = iter(torch.autograd.grad([o for o, _ in pairs], [t for t, n in zip(wanted, needs) if n],
                                         [g for _, g in pairs], allow_unused=True))
        result = []
        for t, need in zip(inputs, needs):
            g = next(found) if need else None
            result.append(torch.zeros_like(t) if need and g is None else g)
        return result

    # a cross entropy's rows of losses and the node's value

    def _finished(self, rows: torch.Tensor, finish, inputs) -> torch.Tensor:
        if finish is None:
            return rows
        reduction, k, ignore = finish
        if reduction == "none":
            return rows.reshape(rows.shape[:-1])
        total = rows.sum()
        return total / (inputs[k] != ignore).sum() if reduction == "mean" else total

    def _rows_of(self, grad: torch.Tensor, finish, inputs) -> torch.Tensor:
        """The gradient of an output's rows, from the gradient of the node's value."""
        if finish is None:
            return grad
        reduction, k, ignore = finish
        rows = inputs[k].shape + (1,)
        if reduction == "none":
            return grad.reshape(rows)
        scale = grad / (inputs[k] != ignore).sum() if reduction == "mean" else grad
        return scale.expand(rows)

    def _check_classes(self, inputs) -> None:
        """A class index out of range is an error in eager; the kernel would pick no logit."""
        for finish in self.finish:
            if finish is None:
                continue
            _, k, ignore = finish
            target, classes = inputs[k], next(t for j, t in enumerate(inputs)
                                               if t is not None and self.group.input_kind(j) == FULL).shape[-1]
            bad = ((target < 0) | (target >= classes)) & (target != ignore)
            if bool(bad.any()):
                raise IndexError(f"Target {int(target[bad][0])} is out of bounds: cross_entropy over {classes} "
                                 "classes takes class indices in [0, classes) or ignore_index")
