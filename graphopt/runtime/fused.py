"""Running a fused elementwise group: autograd-aware, each kernel compiled once per structural key.

1. FusedOp(group)(*inputs) (or fused_call(group, *inputs)) applies an autograd.Function: its forward
   runs the group and keeps only the inputs its backward kernel reads (for the inputs that need a
   gradient: drop-path's x * mask + residual keeps the mask), the others as meta tensors of their
   shapes, strides and dtypes (no memory); its backward computes every input gradient in one
   pass, recomputing the intermediates. A group holding a dropout in training is called
   without its mask: the call draws it (dropout_masks.py) and passes it on as one more input,
   which the backward reads; a stochastic depth's bernoulli is given the tensor whose shape
   its mask takes, and the call puts the mask in its place.
2. Where it runs: CUDA tensors run the generated Triton kernels; CPU (and other) tensors run the
   torch reference (codegen/reference.py), except under TRITON_INTERPRET=1, where CPU tensors run the
   Triton kernels in Triton's interpreter: that is how CI tests the codegen. FakeTensors take the
   same path without launching a kernel, so they allocate what a real run allocates; meta
   tensors only get outputs of the right shapes and dtypes.
3. Kernels are cached in a module-level dict by their Spec (ops, params, dtypes, layout patterns,
   merged rank, offset width), never by sizes: a new batch size reuses the kernel. Each FusedOp also
   remembers its plans and kernels by its inputs' dtypes, shapes and strides, so a repeated call
   skips the planning (Python time a small tensor would notice).
4. Outputs are allocated contiguous at their eager shapes; the grid is cdiv(n, BLOCK).
5. A broadcast input's gradient comes back at the full shape in fp32 and is summed down to the
   input's shape, then cast to its dtype.
6. Each forward and each backward that computes counts as one launch (launch_count()); the torch
   calls a run makes inside (allocations, the CPU reference) run under running_fused(), so a
   dispatch-level op counter can tell them from the graph's own ops.
"""
from __future__ import annotations

import gc
import math
import os
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.autograd.function import once_differentiable

from ..codegen.backward import KERNEL as BACKWARD
from ..codegen.backward import backward_source
from ..codegen.compile import load
from ..codegen.forward import KERNEL as FORWARD
from ..codegen.forward import forward_source
from ..codegen.group import Group, differentiable
from ..codegen.layout import MAX_BLOCK, contiguous_strides
from ..codegen.program import Backward
from ..codegen.reference import reference_source
from ..codegen.spec import LaunchPlan, plan_backward, plan_forward
from .dropout_masks import inserted, with_masks

GPU_BLOCK = 1024
MAX_PLANS = 64  # input signatures each FusedOp remembers (then it starts over)
_KERNELS: dict = {}  # (Spec, interpreted) -> the Triton kernel
_REFERENCES: dict = {}  # (Spec of the backward, or forward) -> the torch reference module
STATS = Counter()  # kernel cache "hits" and "misses", and "launches"
_INSIDE = threading.local()  # .depth: how many fused runs this thread is inside
_GENERATION = [0]  # bumped by clear_cache()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def cache_info() -> dict:
    return {"hits": STATS["hits"], "misses": STATS["misses"], "kernels": len(_KERNELS)}


def launch_count() -> int:
    """Forward and backward runs of fused groups so far (shape-only runs on fake tensors excepted)."""
    return STATS["launches"]


def running_fused() -> bool:
    """Whether this thread is inside a fused group's run: its torch calls are the group's, not the graph's."""
    return getattr(_INSIDE, "depth", 0) > 0


@contextmanager
def _inside():
    _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
    try:
        yield
    finally:
        _INSIDE.depth -= 1


def clear_cache() -> None:
    _KERNELS.clear()
    _REFERENCES.clear()
    STATS.clear()
    _GENERATION[0] += 1  # every FusedOp forgets its remembered plans and kernels


def _signature(tensors) -> tuple:
    return tuple(None if t is None else (t.dtype, t.shape, t.stride()) for t in tensors)


def _shape_only(tensors) -> bool:
    # a plain tensor is never fake: skip is_fake's unwrapping on the common path
    return any(t.device.type == "meta" or (type(t) is not torch.Tensor and torch._subclasses.fake_tensor.is_fake(t))
               for t in tensors)


def _runs_kernel(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def _block(n: int, device: torch.device) -> int:
    if device.type == "cpu":  # the interpreter runs programs one after another: few, large blocks
        return min(MAX_BLOCK, max(16, 1 << (n - 1).bit_length()))
    return GPU_BLOCK


def _kernel(plan: LaunchPlan, name: str, render):
    key = (plan.spec, interpreting())
    kernel = _KERNELS.get(key)
    if kernel is None:
        STATS["misses"] += 1
        kernel = _KERNELS[key] = getattr(load(render(), "_interpreted" if key[1] else ""), name)
    else:
        STATS["hits"] += 1
    return kernel


def _launch(kernel, plan: LaunchPlan, tensors, device: torch.device, scalars: list) -> None:
    n = plan.layout.numel
    block = _block(n, device)
    grid = (triton_cdiv(n, block),)
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            kernel[grid](*tensors, *scalars, BLOCK=block)
    else:
        kernel[grid](*tensors, *scalars, BLOCK=block)
    release_interpreted_arguments()


def release_interpreted_arguments() -> None:
    """Triton's interpreter keeps a launch's tensor storages in a reference cycle (a recursive
    closure over a dict of them) until Python collects it, which can be long after the tensors'
    last use: a measured step would hold them where a GPU run does not. The cycle is young, so a
    collection of the youngest generation frees it."""
    if interpreting():
        gc.collect(0)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _device(inputs) -> torch.device:
    """The device the group runs on: a 0-dim CPU tensor may ride along with CUDA ones, as in eager."""
    devices = {t.device for t in inputs if not (t.dim() == 0 and t.device.type == "cpu")}
    if len(devices) > 1:
        raise ValueError(f"fused group inputs are on several devices {sorted(map(str, devices))}; move them to one")
    return devices.pop() if devices else inputs[0].device


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, *inputs):
        ctx.set_materialize_grads(False)  # a missing output gradient stays None: the kernel skips it
        ctx.op = op
        outputs, dtypes = op.forward(inputs)
        # only what the backward kernel reads: an input it does not read is kept as a meta tensor
        # of its shape, strides and dtype, which is all the backward's plan asks of it
        keep = op.kept_for_backward(inputs, ctx.needs_input_grad[1:])
        ctx.save_for_backward(*[t if keep is None or k in keep else _stand_in(t) for k, t in enumerate(inputs)])
        ctx.device = _device(inputs)
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, dtypes) if not differentiable(d)])
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return (None, *ctx.op.backward(ctx.saved_tensors, grads, ctx.needs_input_grad[1:], ctx.device))


@dataclass
class _Prepared:
    """What calls with one input signature need, worked out on the first of them."""

    plan: LaunchPlan
    program: Backward | None  # the backward's gradient program; None for the forward
    outputs: list = field(default_factory=list)  # forward: (shape, dtype) of each output
    loaded: list = field(default_factory=list)  # forward: the inputs the kernel loads, in signature order
    compiled: dict = field(default_factory=dict)  # interpreting (bool) -> kernel; "reference" -> torch module

    def __post_init__(self):
        self.scalars = self.plan.scalar_args()  # launch arguments after the pointers


class FusedOp:
    """A fused group as a callable: one tensor for a one-output group, else a tuple in group.outputs order.
    It has a __name__, so an FX call_function node can target it."""

    def __init__(self, group: Group, draws: tuple = ()):
        self.group = group if isinstance(group, Group) else Group(*group)
        self.draws = tuple(draws)  # (input place, keep, dtype, sourced) of each mask the call draws (dropout_masks.py)
        self.__name__ = "fused_" + "_".join(s.op for s in self.group.steps)[:80]
        self.__qualname__ = self.__name__
        self._memo: dict = {}  # (kind, input signature) -> _Prepared
        self._generation = _GENERATION[0]

    def __getstate__(self):
        return {"group": self.group, "draws": self.draws}  # kernels do not pickle (deepcopy of a GraphModule)

    def __setstate__(self, state):
        self.__init__(state["group"], state.get("draws", ()))

    def _remembered(self, key, make) -> _Prepared:
        if self._generation != _GENERATION[0] or len(self._memo) >= MAX_PLANS:
            self._memo.clear()
            self._generation = _GENERATION[0]
        entry = self._memo.get(key)
        if entry is None:
            entry = self._memo[key] = make()
        return entry

    def _prepare_forward(self, inputs) -> _Prepared:
        plan = plan_forward(self.group, inputs)
        return _Prepared(plan, None, outputs=[(plan.shapes[j], plan.dtypes[j]) for j in self.group.outputs],
                         loaded=[int(o.name[1:]) for o in plan.spec.operands if o.name.startswith("x")])

    def _prepare_backward(self, inputs, grads, needs) -> _Prepared:
        return _Prepared(*plan_backward(self.group, inputs, grads, needs))

    def _kernel_for(self, entry: _Prepared, name, render):
        mode = interpreting()
        kernel = entry.compiled.get(mode)
        if kernel is None:
            kernel = entry.compiled[mode] = _kernel(entry.plan, name, render)
        else:
            STATS["hits"] += 1
        return kernel

    def __repr__(self) -> str:
        return f"FusedOp({self.group.describe()})"

    def __call__(self, *inputs):
        taken = len(self.group.inputs) - inserted(self.draws)
        if len(inputs) != taken:
            raise TypeError(f"{self.__name__} takes {taken} tensors, got {len(inputs)}")
        for k, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.__name__}: input {k} is {type(t).__name__}; group inputs are tensors "
                                "(put Python numbers into the steps as scalar args)")
        if self.draws:  # a dropout's mask has the group's shape: the others broadcast to it
            inputs = with_masks(inputs, self.draws, torch.broadcast_shapes(*(t.shape for t in inputs)), _device(inputs))
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            outputs = _Function.apply(self, *inputs)
        else:  # nothing to differentiate: skip the autograd.Function (its Python costs a small tensor time)
            outputs = tuple(self.forward(inputs)[0])
        return outputs[0] if len(outputs) == 1 else outputs

    # the two halves of the autograd.Function, on plain tensors

    def forward(self, inputs) -> tuple[list[torch.Tensor], list[torch.dtype]]:
        with _inside():
            return self._forward(inputs)

    def backward(self, inputs, grads, needs, device: torch.device | None = None) -> list[torch.Tensor | None]:
        """The inputs' gradients; an input the kernel does not read may be a meta tensor of its
        shape (kept_for_backward), the group's device then given."""
        with _inside():
            return self._backward(inputs, grads, needs, device or _device(inputs))

    def kept_for_backward(self, inputs, needs) -> frozenset | None:
        """The inputs the backward kernel reads with a gradient for every output, for the inputs
        that need one (any backward reads no more); None where the torch reference runs the
        backward, which reads them all."""
        if not (_runs_kernel(_device(inputs)) or _shape_only(inputs)):
            return None
        needs = tuple(bool(n) for n in needs)
        return self._remembered(("kept", _signature(inputs), needs), lambda: self._prepare_kept(inputs, needs))

    def _prepare_kept(self, inputs, needs) -> frozenset:
        forward = self._remembered(("forward", _signature(inputs)), lambda: self._prepare_forward(inputs))
        grads = [_meta(shape, dtype) if differentiable(dtype) else None for shape, dtype in forward.outputs]
        _, program = plan_backward(self.group, inputs, grads, needs)
        return frozenset(program.inputs)

    def _forward(self, inputs):
        entry = self._remembered(("forward", _signature(inputs)), lambda: self._prepare_forward(inputs))
        plan = entry.plan
        device = _device(inputs)
        dtypes = [d for _, d in entry.outputs]
        if plan.layout.numel == 0 or (_shape_only(inputs) and device.type == "meta"):
            return [torch.empty(s, dtype=d, device=device) for s, d in entry.outputs], dtypes
        # FakeTensors take the path the device takes, allocating what it allocates (the memory
        # estimate counts it); only the kernel launch is left out.
        fake = _shape_only(inputs)
        STATS["launches"] += not fake
        if not _runs_kernel(device):
            values = self._reference(entry).reference_forward(*inputs)
            return [torch.empty(s, dtype=d, device=device).copy_(v) for v, (s, d) in zip(values, entry.outputs)], dtypes
        outputs = [torch.empty(s, dtype=d, device=device) for s, d in entry.outputs]
        if fake:
            return outputs, dtypes
        loaded = [inputs[k].to(device) for k in entry.loaded]
        kernel = self._kernel_for(entry, FORWARD, lambda: forward_source(self.group, plan.spec, plan.dtypes))
        _launch(kernel, plan, loaded + outputs, device, entry.scalars)
        return outputs, dtypes

    def _backward(self, inputs, grads, needs, device: torch.device):
        key = ("backward", _signature(inputs), _signature(grads), tuple(needs))
        entry = self._remembered(key, lambda: self._prepare_backward(inputs, grads, needs))
        plan, program = entry.plan, entry.program
        result: list[torch.Tensor | None] = [None] * len(inputs)
        if not program.grads:
            return result
        kept = [t for t in inputs if t.device.type != "meta" or device.type == "meta"]
        fake = device.type == "meta" or _shape_only(kept + [g for g in grads if g is not None])
        if device.type != "meta" and any(inputs[k].device.type == "meta" for k in program.inputs):
            raise RuntimeError(f"{self.__name__}: the backward reads an input the forward did not keep; "
                               "this is a graphopt bug, please report it")
        if plan.layout.numel == 0 or (fake and device.type == "meta"):
            for k in program.grads:
                result[k] = torch.zeros(inputs[k].shape, dtype=inputs[k].dtype, device=device)
            return result
        STATS["launches"] += not fake
        if not _runs_kernel(device):
            values = self._reference(entry).reference_backward(*inputs, *grads)
            for k, v in zip(program.grads, values):
                result[k] = v.to(inputs[k].dtype)
            return result
        operands = {o.name: o for o in plan.spec.operands}
        buffers = {k: torch.empty(inputs[k].shape if operands[f"d{k}"].dtype == inputs[k].dtype
                                  and math.prod(inputs[k].shape) == plan.layout.numel else plan.full,
                                  dtype=operands[f"d{k}"].dtype, device=device) for k in program.grads}
        tensors = ([inputs[k].to(device) for k in program.inputs] + [grads[i].to(device) for _, i in program.seeds]
                   + [buffers[k] for k in program.grads])
        if not fake:
            kernel = self._kernel_for(entry, BACKWARD, lambda: backward_source(self.group, plan.spec, program))
            _launch(kernel, plan, tensors, device, entry.scalars)
        for k, buffer in buffers.items():
            result[k] = buffer.sum_to_size(inputs[k].shape).to(inputs[k].dtype)
        return result

    def _reference(self, entry: _Prepared):
        module = entry.compiled.get("reference")
        if module is None:
            plan = entry.plan
            module = _REFERENCES.get(plan.spec)
            if module is None:
                module = _REFERENCES[plan.spec] = load(reference_source(self.group, plan.dtypes, entry.program))
            entry.compiled["reference"] = module
        return module


def fused_call(group: Group, *inputs):
    """Run `group` on `inputs` (see FusedOp)."""
    return FusedOp(group)(*inputs)


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A real meta tensor of t's shape, strides and dtype (no memory, even while FakeTensors run:
    a fake one would stand for memory to the estimate)."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        return _meta(t.shape, t.dtype, t.stride())


def _meta(shape, dtype, strides=None) -> torch.Tensor:
    shape = tuple(shape)
    return torch.empty_strided(shape, tuple(strides) if strides else contiguous_strides(shape), dtype=dtype,
                               device="meta")


def example(group: Group, shapes, dtypes, strides=None):
    """Meta inputs, and for the backward the incoming gradients (contiguous, one per float output) and
    which inputs want one (the float ones)."""
    group = group if isinstance(group, Group) else Group(*group)
    inputs = [_meta(s, d, strides[k] if strides else None) for k, (s, d) in enumerate(zip(shapes, dtypes))]
    plan = plan_forward(group, inputs)
    grads = [_meta(plan.shapes[j], plan.dtypes[j]) if differentiable(plan.dtypes[j]) else None
             for j in group.outputs]
    return group, inputs, plan, grads, [differentiable(d) for d in dtypes]


def source(group: Group, shapes, dtypes, strides=None) -> tuple[str, str | None]:
    """The forward and backward Triton sources for inputs of these shapes, dtypes (and strides,
    default contiguous); backward is None when no input gets a gradient."""
    group, inputs, plan, grads, needs = example(group, shapes, dtypes, strides)
    forward = forward_source(group, plan.spec, plan.dtypes)
    bplan, program = plan_backward(group, inputs, grads, needs)
    return forward, (backward_source(group, bplan.spec, program) if program.grads else None)


def repro_script(group: Group, shapes, dtypes) -> str:
    """A standalone script: random inputs of these shapes and dtypes, the kernels, the torch reference."""
    from ..codegen.repro import render
    group, inputs, plan, grads, needs = example(group, shapes, dtypes)
    bplan, program = plan_backward(group, inputs, grads, needs)
    return render(group, plan, bplan, program, [tuple(s) for s in shapes], list(dtypes))
