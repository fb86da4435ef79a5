"""Running a fused elementwise group: autograd-aware, everything a call derives bound once per
input signature.

1. FusedOp(group)(*inputs) (or fused_call(group, *inputs)): the first call of an input signature
   (each input's type, dtype, shape, strides, device and requires_grad, and the grad mode) binds
   a _Forward: the launch plan, the outputs' shapes and dtypes, what the backward kernel reads,
   the kernel and its launch with grid, sizes and strides bound (launch.py). A later call of that
   signature makes one tuple, finds its _Forward, allocates the outputs and launches.
2. Under autograd the _Forward is applied as an autograd.Function whose forward saves only the
   inputs the backward kernel reads (for the inputs that need a gradient: drop-path's
   x * mask + residual keeps the mask); the others' shapes are the _Forward's. Its backward binds
   a _Backward per signature of the incoming gradients: the plan, the gradient buffers' shapes and
   dtypes, which of them are summed down to a broadcast input's shape or cast to its dtype, and
   the launch; it computes every input gradient in one pass, recomputing the intermediates. A
   group holding a dropout in training is called without its mask: the call draws it
   (dropout_masks.py) and passes it on as one more input, which the backward reads; a stochastic
   depth's bernoulli is given the tensor whose shape its mask takes, and the call puts the mask
   in its place.
3. Where it runs: CUDA tensors run the generated Triton kernels; CPU (and other) tensors run the
   torch reference (codegen/reference.py), except under TRITON_INTERPRET=1, where CPU tensors run the
   Triton kernels in Triton's interpreter: that is how CI tests the codegen. FakeTensors take the
   same path without launching a kernel, so they allocate what a real run allocates; meta
   tensors only get outputs of the right shapes and dtypes.
4. Kernels are cached in a module-level dict by their Spec (ops, params, dtypes, layout patterns,
   merged rank, offset width), never by sizes: a new batch size binds again and reuses the kernel.
5. Outputs are allocated contiguous at their eager shapes; the grid is cdiv(n, BLOCK).
6. A broadcast input's gradient comes back at the full shape in fp32 and is summed down to the
   input's shape, then cast to its dtype.
7. Each forward and each backward that computes counts as one launch (launch_count()); the torch
   calls a run makes inside (allocations, the CPU reference) run where running_fused() is true, so a
   dispatch-level op counter can tell them from the graph's own ops.
"""
from __future__ import annotations

import math
import threading
from collections import Counter

import torch
from torch.autograd.function import once_differentiable

from ..codegen.backward import KERNEL as BACKWARD
from ..codegen.backward import backward_source
from ..codegen.compile import load
from ..codegen.forward import KERNEL as FORWARD
from ..codegen.forward import forward_source
from ..codegen.group import Group, differentiable
from ..codegen.layout import MAX_BLOCK, contiguous_strides
from ..codegen.reference import reference_source
from ..codegen.spec import LaunchPlan, plan_backward, plan_forward
from ..errors import traced_kinds_refused
from ..vocabulary.precisions import torch_name
from .dropout_masks import inserted, with_masks, with_stand_ins
from .launch import bind, interpreting

GPU_BLOCK = 1024
MAX_PLANS = 64  # input signatures each FusedOp remembers (then it starts over)
_KERNELS: dict = {}  # (Spec, interpreted) -> the Triton kernel
_REFERENCES: dict = {}  # (Spec of the backward, or forward) -> the torch reference module
STATS = Counter()  # kernel cache "hits" and "misses" (at binding), and "launches"


class _Depth(threading.local):
    depth = 0  # how many fused runs this thread is inside (a class default: no getattr per call)


_INSIDE = _Depth()
_GENERATION = [0]  # bumped by clear_cache()


def cache_info() -> dict:
    return {"hits": STATS["hits"], "misses": STATS["misses"], "kernels": len(_KERNELS)}


def launch_count() -> int:
    """Forward and backward runs of fused groups so far (shape-only runs on fake tensors excepted)."""
    return STATS["launches"]


def running_fused() -> bool:
    """Whether this thread is inside a fused group's run: its torch calls are the group's, not the graph's."""
    return _INSIDE.depth > 0


def enter() -> None:
    _INSIDE.depth += 1


def leave() -> None:
    _INSIDE.depth -= 1


def clear_cache() -> None:
    _KERNELS.clear()
    _REFERENCES.clear()
    STATS.clear()
    _GENERATION[0] += 1  # every fused op forgets its bound calls


def signature_key(tensors) -> tuple:
    """What a bound call depends on, per tensor: its class (a FakeTensor runs no kernel), dtype,
    shape, strides, device and whether it wants a gradient. AttributeError for a non-tensor."""
    return tuple([(t.__class__, t.dtype, t.shape, t.stride(), t.device, t.requires_grad) for t in tensors])


def shape_only(tensors) -> bool:
    """Whether these tensors have no data: meta tensors, or FakeTensors (a plain tensor is never fake:
    is_fake's unwrapping is skipped for it)."""
    return any(t.device.type == "meta" or (type(t) is not torch.Tensor and torch._subclasses.fake_tensor.is_fake(t))
               for t in tensors)


def runs_kernel(device: torch.device) -> bool:
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


def _launch(kernel, plan: LaunchPlan, device: torch.device, scalars) -> callable:
    n = plan.layout.numel
    block = _block(n, device)
    return bind(kernel, (triton_cdiv(n, block),), tuple(scalars), {"BLOCK": block}, device)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_device(inputs) -> torch.device:
    """The device the group runs on: a 0-dim CPU tensor may ride along with CUDA ones, as in eager."""
    devices = {t.device for t in inputs if not (t.dim() == 0 and t.device.type == "cpu")}
    if len(devices) > 1:
        raise ValueError(f"fused group inputs are on several devices {sorted(map(str, devices))}; move them to one")
    return devices.pop() if devices else inputs[0].device


def check_kinds(name: str, kinds: tuple, inputs) -> None:
    """Refuse inputs of other dtypes than the group was traced with, or (tensors with data) on
    other devices: its steps compute in the traced dtypes, and the checks of its values that the
    fuse pass dropped hold for those alone. Run where a call's signature binds."""
    for k, (kind, t) in enumerate(zip(kinds, inputs)):
        if kind is None or (t.dtype == kind[0] and (t.device.type == kind[1] or shape_only([t]))):
            continue
        raise traced_kinds_refused(f"{name} was built for {torch_name(kind[0])} on {kind[1]} at its input {k}, "
                                   f"and got {torch_name(t.dtype)} on {t.device.type}")


def mode_of(tensors, device: torch.device) -> str:
    """How a bound call runs: "meta" (outputs of the right shapes only), "fake" (allocating what a run
    allocates, launching nothing), "kernel" (the Triton kernels) or "reference" (the torch reference)."""
    if device.type == "meta":
        return "meta"
    if shape_only(tensors):
        return "fake"
    return "kernel" if runs_kernel(device) else "reference"


def _riders(inputs, device: torch.device) -> tuple:
    """Inputs on another device than the group's (0-dim CPU tensors beside CUDA ones): moved at each call."""
    return tuple(k for k, t in enumerate(inputs) if t.device != device)


def _moved(tensors, riders, device):
    tensors = list(tensors)
    for k in riders:
        tensors[k] = tensors[k].to(device)
    return tensors


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, *inputs):
        ctx.set_materialize_grads(False)  # a missing output gradient stays None: the kernel skips it
        ctx.call = call
        outputs = call.run(inputs)
        ctx.save_for_backward(*[inputs[k] for k in call.kept])  # only what the backward kernel reads
        if call.non_differentiable:
            ctx.mark_non_differentiable(*[outputs[i] for i in call.non_differentiable])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():  # create_graph: the gradients are not differentiable again
            return _once_backward(ctx, *grads)
        return (None, *ctx.call.backward(ctx.saved_tensors, grads, ctx.needs_input_grad[1:]))


@once_differentiable
def _once_backward(ctx, *grads):
    return (None, *ctx.call.backward(ctx.saved_tensors, grads, ctx.needs_input_grad[1:]))


class _Forward:
    """One input signature's forward, bound: what every call of it needs, derived once."""

    def __init__(self, op: "FusedOp", inputs, autograd: bool):
        self.op, self.autograd = op, autograd
        self.device = group_device(inputs)
        self.mode = mode_of(inputs, self.device)
        self.cpu = self.device.type == "cpu"  # where TRITON_INTERPRET decides the path (tests change it)
        self.interpreted = interpreting()
        self.plan = plan_forward(op.group, inputs)
        self.outputs = tuple((tuple(self.plan.shapes[j]), self.plan.dtypes[j]) for j in op.group.outputs)
        self.single = len(self.outputs) == 1
        self.non_differentiable = tuple(i for i, (_, d) in enumerate(self.outputs) if not differentiable(d))
        self.inputs = tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in inputs)
        self.riders = _riders(inputs, self.device) if self.device.type != "meta" else ()
        self.loaded = tuple(int(o.name[1:]) for o in self.plan.spec.operands if o.name.startswith("x"))
        self.empty = self.plan.layout.numel == 0
        needs = tuple(t.requires_grad for t in inputs)
        # the backward kernel reads no more than with a gradient for every output; the reference reads all
        self.kept = tuple(range(len(inputs))) if self.mode == "reference" or not autograd else \
            tuple(sorted(self._read_by_backward(needs)))
        self.backwards: dict = {}
        self.launch = None
        if self.mode == "kernel" and not self.empty:
            kernel = op.kernel(self.plan, FORWARD, lambda: forward_source(op.group, self.plan.spec, self.plan.dtypes))
            self.launch = _launch(kernel, self.plan, self.device, self.plan.scalar_args())
        self.run = {"kernel": self._kernel, "fake": self._allocate, "meta": self._allocate,
                    "reference": self._reference}[self.mode] if not self.empty else self._allocate

    def _read_by_backward(self, needs) -> frozenset:
        grads = [_meta(shape, dtype) if differentiable(dtype) else None for shape, dtype in self.outputs]
        _, program = plan_backward(self.op.group, self.stand_ins(), grads, needs)
        return frozenset(program.inputs)

    def stand_ins(self) -> list[torch.Tensor]:
        """Real meta tensors of the inputs' shapes, strides and dtypes (no memory, even while FakeTensors
        run: a fake one would stand for memory to the estimate): what a plan asks of an input."""
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            return [_meta(shape, dtype, strides) for shape, strides, dtype in self.inputs]

    def __call__(self, inputs):
        if self.op.draws:
            inputs = with_masks(inputs, self.op.draws, self.plan.full, self.device)
        outputs = _Function.apply(self, *inputs) if self.autograd else self.run(inputs)
        return outputs[0] if self.single else outputs

    def _allocate(self, inputs) -> tuple:
        device = self.device
        return tuple([torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.outputs])

    def _kernel(self, inputs) -> tuple:
        enter()
        try:
            outputs = self._allocate(inputs)
            if self.riders:
                inputs = _moved(inputs, self.riders, self.device)
            self.launch(*[inputs[k] for k in self.loaded], *outputs)
            STATS["launches"] += 1
            return outputs
        finally:
            leave()

    def _reference(self, inputs) -> tuple:
        enter()
        try:
            module = self.op.reference(self.plan, None)
            values = module.reference_forward(*inputs)
            STATS["launches"] += 1
            return tuple([torch.empty(s, dtype=d, device=self.device).copy_(v)
                          for v, (s, d) in zip(values, self.outputs)])
        finally:
            leave()

    def backward(self, saved, grads, needs) -> list:
        key = (needs, *[None if g is None else (g.__class__, g.dtype, g.shape, g.stride()) for g in grads])
        call = self.backwards.get(key)
        if call is None:
            if len(self.backwards) >= MAX_PLANS:
                self.backwards.clear()
            call = self.backwards[key] = _Backward(self, grads, needs)
        return call.run(saved, grads)


class _Backward:
    """One signature of a forward's incoming gradients, bound: the plan, the gradient buffers, what is
    summed down or cast, the launch."""

    def __init__(self, forward: _Forward, grads, needs):
        self.forward = forward
        op, device = forward.op, forward.device
        self.mode = "meta" if device.type == "meta" else forward.mode
        if self.mode == "kernel" and shape_only([g for g in grads if g is not None]):
            self.mode = "fake"
        self.plan, self.program = plan_backward(op.group, forward.stand_ins(), grads, needs)
        program, inputs = self.program, forward.inputs
        missing = set(program.inputs) - set(forward.kept)
        if missing:
            raise RuntimeError(f"{op.__name__}: the backward reads an input the forward did not keep; "
                               "this is a graphopt bug, please report it")
        self.count = len(inputs)
        self.grads = program.grads
        operands = {o.name: o for o in self.plan.spec.operands}
        n = self.plan.layout.numel
        self.buffers = []  # (shape, dtype, input place, summed down to, cast to)
        for k in program.grads:
            shape, _, dtype = inputs[k]
            kind = operands[f"d{k}"].dtype
            whole = kind == dtype and math.prod(shape) == n
            size = shape if whole else tuple(self.plan.full)
            self.buffers.append((size, kind, k, None if size == shape else shape, None if kind == dtype else dtype))
        places = {k: i for i, k in enumerate(forward.kept)}
        self.reads = tuple(places[k] for k in program.inputs)
        self.seeds = tuple(i for _, i in program.seeds)
        self.riders = forward.riders
        self.launch = None
        if self.mode == "kernel" and n and program.grads:
            kernel = op.kernel(self.plan, BACKWARD, lambda: backward_source(op.group, self.plan.spec, program))
            self.launch = _launch(kernel, self.plan, device, self.plan.scalar_args())
        if not program.grads:
            self.run = self._nothing
        elif self.mode == "meta" or not n:
            self.run = self._zeros
        else:
            self.run = {"kernel": self._kernel, "fake": self._kernel, "reference": self._reference}[self.mode]

    def _nothing(self, saved, grads) -> list:
        return [None] * self.count

    def _zeros(self, saved, grads) -> list:
        result = [None] * self.count
        for k in self.grads:
            shape, _, dtype = self.forward.inputs[k]
            result[k] = torch.zeros(shape, dtype=dtype, device=self.forward.device)
        return result

    def _kernel(self, saved, grads) -> list:
        enter()
        try:
            device = self.forward.device
            buffers = [torch.empty(size, dtype=kind, device=device) for size, kind, *_ in self.buffers]
            if self.launch is not None:
                reads = [saved[i] for i in self.reads]
                if self.riders:
                    reads = [t.to(device) for t in reads]
                self.launch(*reads, *[grads[i] for i in self.seeds], *buffers)
                STATS["launches"] += 1
            result = [None] * self.count
            for buffer, (_, _, k, down, cast) in zip(buffers, self.buffers):
                if down is not None:
                    buffer = buffer.sum_to_size(down)
                result[k] = buffer if cast is None else buffer.to(cast)
            return result
        finally:
            leave()

    def _reference(self, saved, grads) -> list:
        enter()
        try:
            values = self.forward.op.reference(self.plan, self.program).reference_backward(*saved, *grads)
            STATS["launches"] += 1
            result = [None] * self.count
            for k, v in zip(self.program.grads, values):
                result[k] = v.to(self.forward.inputs[k][2])
            return result
        finally:
            leave()


class FusedOp:
    """A fused group as a callable: one tensor for a one-output group, else a tuple in group.outputs order.
    It has a __name__, so an FX call_function node can target it."""

    def __init__(self, group: Group, draws: tuple = (), kinds: tuple = ()):
        self.group = group if isinstance(group, Group) else Group(*group)
        self.draws = tuple(draws)  # (input place, keep, dtype, sourced) of each mask the call draws (dropout_masks.py)
        self.kinds = tuple(kinds)  # per input taken, its traced (dtype, device type) or None: check_kinds
        self.taken = len(self.group.inputs) - inserted(self.draws)
        self.__name__ = "fused_" + "_".join(s.op for s in self.group.steps)[:80]
        self.__qualname__ = self.__name__
        self._memo: dict = {}  # (grad mode, input signature) -> _Forward
        self._generation = _GENERATION[0]

    def __getstate__(self):
        return {"group": self.group, "draws": self.draws, "kinds": self.kinds}  # kernels do not pickle (deepcopy)

    def __setstate__(self, state):
        self.__init__(state["group"], state.get("draws", ()), state.get("kinds", ()))

    def __repr__(self) -> str:
        return f"FusedOp({self.group.describe()})"

    def __call__(self, *inputs):
        if len(inputs) != self.taken:
            raise TypeError(f"{self.__name__} takes {self.taken} tensors, got {len(inputs)}")
        try:
            key = (torch.is_grad_enabled(), signature_key(inputs))
        except AttributeError:
            raise self._not_tensors(inputs) from None
        call = self._memo.get(key)
        if call is None or (call.cpu and call.interpreted != interpreting()) or self._generation != _GENERATION[0]:
            call = self._bind(key, inputs)
        return call(inputs)

    def _not_tensors(self, inputs) -> TypeError:
        k, t = next((k, t) for k, t in enumerate(inputs) if not isinstance(t, torch.Tensor))
        return TypeError(f"{self.__name__}: input {k} is {type(t).__name__}; group inputs are tensors "
                         "(put Python numbers into the steps as scalar args)")

    def _bind(self, key, inputs) -> _Forward:
        check_kinds(self.__name__, self.kinds, inputs)
        if self._generation != _GENERATION[0] or len(self._memo) >= MAX_PLANS:
            self._memo.clear()
            self._generation = _GENERATION[0]
        if self.draws:  # a dropout's mask has the group's shape: the others broadcast to it
            inputs = with_stand_ins(inputs, self.draws, torch.broadcast_shapes(*(t.shape for t in inputs)),
                                    group_device(inputs))
        autograd = key[0] and any(t.requires_grad for t in inputs)
        call = self._memo[key] = _Forward(self, inputs, autograd)
        return call

    def kernel(self, plan: LaunchPlan, name: str, render):
        """The Triton kernel of this plan, compiled once per Spec."""
        return _kernel(plan, name, render)

    def reference(self, plan: LaunchPlan, program):
        """The torch reference module of this plan (backward: with its program), built once per Spec."""
        module = _REFERENCES.get(plan.spec)
        if module is None:
            module = _REFERENCES[plan.spec] = load(reference_source(self.group, plan.dtypes, program))
        return module


def fused_call(group: Group, *inputs):
    """Run `group` on `inputs` (see FusedOp)."""
    return FusedOp(group)(*inputs)


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
