"""What a generated kernel depends on (its Spec, the cache key) and what a launch passes it (LaunchPlan).

1. dtypes: step dtypes from the inputs' dtypes (group.step_dtypes; Unsupported when declined).
2. Tensors the kernel touches, in signature order: the inputs it loads (x{k}), then the outputs it
   stores (forward: out{i}), or the incoming gradients (g{i}) and the input gradients it stores
   (backward: d{k}).
3. Their strides over the full shape are collapsed (layout.py); the Spec keeps each tensor's dtype and
   pattern, the merged rank and the 64-bit decision; the LaunchPlan keeps the sizes and strides.
4. Launch arguments: the pointers, n, the sizes the unravel divides by, then each "s" stride.
5. The backward's Spec also keeps which adjoints are rounded to their fp16/bf16 dtype: only those of
   values that span the full shape are (program.py), which neither dtypes nor layout patterns tell apart.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import layout as L
from .group import Group, Value, as_value, step_dtypes, step_shapes
from .program import Backward, backward_program


@dataclass(frozen=True)
class Operand:
    name: str  # x{k}, out{i}, g{i}, d{k}
    dtype: torch.dtype
    pattern: object  # "flat" or per merged dim 0 / 1 / "s"


@dataclass(frozen=True)
class Spec:
    kind: str  # "forward" or "backward"
    structure: tuple  # Group.structure()
    inputs: tuple  # Value per group input: dtype and 0-dim-ness decide the step dtypes
    operands: tuple  # Operand per pointer argument
    rank: int
    index64: bool
    has_grad: tuple = ()  # backward: output i has an incoming gradient
    needs: tuple = ()  # backward: input k wants a gradient
    spans: tuple = ()  # backward: (i, pattern) for each seeded output smaller than the full shape
    rounded_adjoints: tuple = ()  # backward: those rounded to their fp16/bf16 dtype, by sizes (program.py)

    def mask_dims(self, i: int) -> list[int]:
        """Dims along which output i is broadcast: its gradient counts once, at index 0 of them."""
        pattern = dict(self.spans).get(i, "flat")
        return [] if pattern == "flat" else [d for d, v in enumerate(pattern) if v == 0]

    def unravel(self) -> list[int]:
        extra = [d for i, _ in self.spans for d in self.mask_dims(i)]
        return L.unravel_dims([o.pattern for o in self.operands], self.rank, extra)

    def size_params(self) -> list[int]:
        return L.size_params(self.unravel(), self.rank)

    def stride_params(self) -> list[tuple[int, int]]:
        return [(k, d) for k, o in enumerate(self.operands) if o.pattern != "flat"
                for d, v in enumerate(o.pattern) if v == "s"]


@dataclass(frozen=True)
class LaunchPlan:
    spec: Spec
    layout: L.Layout
    full: tuple  # the unmerged full shape
    dtypes: tuple  # every step's dtype
    shapes: tuple  # every step's eager shape

    def scalar_args(self) -> list[int]:
        lay, spec = self.layout, self.spec
        return ([lay.numel] + [lay.sizes[d] for d in spec.size_params()]
                + [lay.strides[k][d] for k, d in spec.stride_params()])


def _values_and_shapes(group: Group, inputs):
    values = tuple(as_value(t) for t in inputs)
    dtypes = tuple(step_dtypes(group, values))
    try:
        shapes = tuple(step_shapes(group, [tuple(t.shape) for t in inputs]))
        full = tuple(torch.broadcast_shapes(*(tuple(t.shape) for t in inputs)))
    except RuntimeError as e:
        raise ValueError(f"the fused group's input shapes {[tuple(t.shape) for t in inputs]} do not broadcast "
                         f"together: {e}") from None
    return values, dtypes, shapes, full


def _contiguous(shape, full):
    return L.expanded_strides(shape, L.contiguous_strides(shape), full)


def _used_inputs(group: Group) -> list[int]:
    return sorted({a[1] for s in group.steps for a in s.args if isinstance(a, tuple) and a[0] == "input"})


def plan_forward(group: Group, inputs) -> LaunchPlan:
    values, dtypes, shapes, full = _values_and_shapes(group, inputs)
    loaded = _used_inputs(group)
    names = [f"x{k}" for k in loaded] + [f"out{i}" for i in range(len(group.outputs))]
    kinds = [values[k].dtype for k in loaded] + [dtypes[j] for j in group.outputs]
    strides = ([L.expanded_strides(inputs[k].shape, inputs[k].stride(), full) for k in loaded]
               + [_contiguous(shapes[j], full) for j in group.outputs])
    lay = L.collapse(full, strides)
    operands = tuple(Operand(n, d, lay.pattern(k)) for k, (n, d) in enumerate(zip(names, kinds)))
    spec = Spec("forward", group.structure(), values, operands, lay.rank, lay.index64())
    return LaunchPlan(spec, lay, full, dtypes, shapes)


def grad_buffer_dtype(program, k: int, value: Value, shape, n: int) -> torch.dtype:
    """An input gradient is stored in the input's dtype when it needs no reduction, or when its one
    term is already rounded to that dtype (eager sums that tensor: a bias's gradient in bf16); else
    in fp32 for the sum of its terms."""
    if math.prod(shape) == n:
        return value.dtype
    terms = [c for c in program.contributions if c.target == f"d{k}"]
    if len(terms) == 1 and terms[0].rounds and terms[0].rounds[-1] == value.dtype:
        return value.dtype
    return torch.float32


def plan_backward(group: Group, inputs, grads, needs) -> tuple[LaunchPlan, Backward]:
    """grads: the incoming gradient per output (None: zero); needs: per input, whether it wants one."""
    values, dtypes, shapes, full = _values_and_shapes(group, inputs)
    has_grad = tuple(g is not None for g in grads)
    n = math.prod(full)
    spanning = ({("input", k) for k, t in enumerate(inputs) if math.prod(t.shape) == n}
                | {("step", j) for j, s in enumerate(shapes) if math.prod(s) == n})
    program = backward_program(group, [v.dtype for v in values], dtypes, has_grad, tuple(needs), spanning)
    seeded = [i for _, i in program.seeds]
    names = ([f"x{k}" for k in program.inputs] + [f"g{i}" for i in seeded] + [f"d{k}" for k in program.grads])
    kinds = ([values[k].dtype for k in program.inputs] + [grads[i].dtype for i in seeded]
             + [grad_buffer_dtype(program, k, values[k], inputs[k].shape, n) for k in program.grads])
    strides = ([L.expanded_strides(inputs[k].shape, inputs[k].stride(), full) for k in program.inputs]
               + [L.expanded_strides(grads[i].shape, grads[i].stride(), full) for i in seeded]
               + [L.contiguous_strides(full) for _ in program.grads])
    small = [i for i in seeded if math.prod(shapes[group.outputs[i]]) != n]
    lay = L.collapse(full, strides + [_contiguous(shapes[group.outputs[i]], full) for i in small])
    operands = tuple(Operand(n_, d, lay.pattern(k)) for k, (n_, d) in enumerate(zip(names, kinds)))
    spans = tuple((i, lay.pattern(len(names) + m)) for m, i in enumerate(small))
    layout = L.Layout(lay.numel, lay.sizes, lay.strides[:len(names)])
    spec = Spec("backward", group.structure(), values, operands, lay.rank, layout.index64(), has_grad,
                tuple(needs), spans, program.rounded_adjoints)
    return LaunchPlan(spec, layout, full, dtypes, shapes), program
