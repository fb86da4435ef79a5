"""A recompute segment whose inputs wait on the host until its backward: the checkpoints of a plan
moved off the device, as offloaded gradient checkpointing does (Unsloth, Megatron's activation
offload of a layer's inputs).

A checkpointed segment keeps only its inputs for backward; across a deep model those are what a
recompute plan holds at its least (a decoder's hidden state per layer). OffloadedSegment runs its
GraphModule without grad in the forward, copies each input it would keep to the host, and lets
go of the device's; its backward copies them back, runs the segment again with grad (under
rerun(): batch_norm_once leaves the running statistics alone, the measurement counts it as a
rerun) with the RNG state of the first run where the segment draws, and backpropagates through it
(the reentrant form of torch.utils.checkpoint, which keeps its inputs on the device; written here
for the copies). An input the segment does not own, a leaf or a view of one (a parameter, the
model's input, a mask made without grad), stays where it is: something else holds it.

Copies run beside the step's kernels where they can (runtime/copy_streams.py, on CUDA): each input
goes down to pinned host memory on a stream of its own while the segment computes, and the
backward of a segment brings up the inputs of the one whose backward comes next (the segment
called before it in the forward) while its own rerun and backward compute, so that they are
there when wanted. The order is the same on every device, so the step's measurement on CPU, where
each copy is made at once, counts the device bytes the CUDA step holds: a segment's backward holds
the next one's inputs too. The host's copies are made under on_host(), so the step's measurement
(analysis/live_storage.py) counts them as the host's, also on CPU, where the host copy is a
storage of its own on the same memory.
"""
from __future__ import annotations

import weakref

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import get_device_states, set_device_states

from ..analysis.host_tier import on_host
from ..analysis.segments import SegmentCall, rerun, segment_parameters
from ..errors import UsageError
from . import copy_streams

SECOND_BACKWARD = ("a second backward through this step (retain_graph=True): graphopt's plan keeps these checkpoints' "
                   "inputs on the host, and they come back for one backward only. Backward once per forward, or "
                   "give a budget_gb that keeps them on the device.")


class CallOrder:
    """The offloaded segments of one graph in the order the forward called them: each call's kept
    inputs know the call before them, whose backward comes after theirs."""

    __slots__ = ("last",)

    def __init__(self):
        self.last: weakref.ref | None = None  # the latest call's _Kept: its graph may be gone

    def __deepcopy__(self, memo):
        return CallOrder()

    def __reduce__(self):
        return CallOrder, ()


class OffloadedSegment(SegmentCall):
    """The callable a rewritten graph calls for segment k, its kept inputs on the host; order: the
    graph's segments' (one per graph, given to each)."""

    offloaded = True

    def __init__(self, index: int, module: torch.fx.GraphModule, draws: bool = True, order: CallOrder | None = None):
        super().__init__(index, module, selective=False)
        self.draws = draws
        self.order = order if order is not None else CallOrder()
        self._params, self._params_of = (), None
        self.__module__ = __name__

    def __call__(self, *args):
        if not torch.is_grad_enabled():  # no backward to come (an evaluation under no_grad): nothing to keep
            return tuple(self.module(*args))
        if self._params_of is not self.module:  # the segment's parameters, found once per module
            self._params, self._params_of = tuple(segment_parameters(self)), self.module
        # Where no input needs a gradient but a parameter does (an embedding's segment, whose one
        # input is the token ids), an empty tensor that does tells autograd the outputs need one.
        anchor = () if any(isinstance(t, torch.Tensor) and t.requires_grad for t in args) or \
            not any(p.requires_grad for p in self._params) else (torch.empty(0, requires_grad=True),)
        return _Offloaded.apply(self, len(args), *args, *anchor)


def owned(t) -> bool:
    """Whether t is a tensor the segment's input holds alone: made by the graph with grad, not a
    leaf nor a view of one."""
    if not isinstance(t, torch.Tensor):
        return False
    base = t._base if t._base is not None else t
    return not base.is_leaf


class _Kept:
    """One call's inputs while its backward waits. stored: per input (the host's copy, its device,
    the copy's event) where the segment owns it, else (the input, None, None); back: per input, (the
    tensor on its device, the copy's event or None) once brought; before: the call before it."""

    __slots__ = ("stored", "back", "before", "__weakref__")

    def __init__(self, args, before: weakref.ref | None):
        self.stored = [_down(t) if owned(t) else (t, None, None) for t in args]
        self.back, self.before = None, before

    def bring(self) -> None:
        """Each input on its device again (the copies queued, on CUDA); the host's copies let go."""
        self.back = [(t, None) if device is None else _up(t, device, event) for t, device, event in self.stored]
        self.stored = None

    def inputs(self) -> list:
        """The inputs on their devices, brought now where they were not yet; the step waits for each."""
        if self.back is None:
            self.bring()
        back, self.back = self.back, None
        for t, event in back:
            if event is not None:
                copy_streams.ready(event, t.device)
        return [t for t, _ in back]


def _down(t: torch.Tensor) -> tuple:
    """(t's copy in host memory, t's device, the copy's event: None where it was made at once). On the
    copy streams where t is a CUDA tensor with storage; a fake one, in the estimate's step, is copied
    at once, as on CPU."""
    if t.device.type == "cuda" and not isinstance(t, FakeTensor):
        host, event = copy_streams.down(t.detach())
        return host, t.device, event
    with on_host():
        return t.detach().clone(), t.device, None


def _up(host: torch.Tensor, device: torch.device, event) -> tuple:
    """(host's copy on device, the copy's event or None): on the copy streams where it came down on them."""
    if event is not None:
        return copy_streams.up(host, device, event)
    return host.to(device, copy=True), None


class _Offloaded(torch.autograd.Function):
    """The parameters' gradients accumulate in the backward of the rerun, as torch.utils.checkpoint's
    reentrant form accumulates them; the anchor, where given, gets none."""

    @staticmethod
    def forward(ctx, segment: OffloadedSegment, count: int, *tensors):
        args, ctx.anchored = tensors[:count], len(tensors) > count
        ctx.segment = segment
        ctx.needs = [isinstance(t, torch.Tensor) and t.requires_grad for t in args]
        if segment.draws:  # the rerun draws what the first run drew
            ctx.rng = torch.get_rng_state(), get_device_states(*args)
        ctx.kept = _Kept(args, segment.order.last)
        segment.order.last = weakref.ref(ctx.kept)
        # Each tensor returned as an alias of its own: autograd gives a Function's outputs its history,
        # and an output that is a parameter or a buffer itself (a `.to` of its own dtype returns it) would
        # become a non-leaf of this Function's.
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in segment.module(*args))

    @staticmethod
    def backward(ctx, *grads):
        kept, ctx.kept = ctx.kept, None
        if kept is None:
            raise UsageError(SECOND_BACKWARD)
        inputs = kept.inputs()
        before = kept.before() if kept.before is not None else None
        if before is not None and before.stored is not None:  # its backward is next: its copies run beside this one
            before.bring()
        inputs = [t.detach().requires_grad_(need) if isinstance(t, torch.Tensor) else t
                  for t, need in zip(inputs, ctx.needs)]
        devices = ctx.rng[1][0] if ctx.segment.draws else []
        with torch.random.fork_rng(devices=devices, enabled=ctx.segment.draws), torch.enable_grad(), rerun():
            if ctx.segment.draws:
                torch.set_rng_state(ctx.rng[0])
                set_device_states(*ctx.rng[1])
            out = ctx.segment.module(*inputs)
        pairs = [(o, g) for o, g in zip(out, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:  # the parameters' gradients accumulate as this backward makes them
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[t.grad if need else None for t, need in zip(inputs, ctx.needs)],
                *[None] * ctx.anchored)
