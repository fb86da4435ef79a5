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

On CUDA the host copy is pinned and both copies are non_blocking on the step's stream, which
orders them with the kernels around them. The host's copies are made under on_host(), so the
step's measurement (analysis/live_storage.py) counts them as the host's, also on CPU, where the
host copy is a storage of its own on the same memory.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.utils.checkpoint import get_device_states, set_device_states

from ..analysis.host_tier import on_host
from ..analysis.segments import SegmentCall, rerun


class OffloadedSegment(SegmentCall):
    """The callable a rewritten graph calls for segment k, its kept inputs on the host."""

    offloaded = True

    def __init__(self, index: int, module: torch.fx.GraphModule, draws: bool = True):
        super().__init__(index, module, selective=False)
        self.draws = draws
        self._params, self._params_of = (), None
        self.__module__ = __name__

    def __call__(self, *args):
        if not torch.is_grad_enabled():  # no backward to come (an evaluation under no_grad): nothing to keep
            return tuple(self.module(*args))
        if self._params_of is not self.module:  # the segment's parameters, found once per module
            self._params, self._params_of = tuple(self.module.parameters()), self.module
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
        ctx.kept = [(_to_host(t), t.device) if owned(t) else (t, None) for t in args]
        return tuple(segment.module(*args))

    @staticmethod
    def backward(ctx, *grads):
        inputs = [_to_device(t, device) if device is not None else t for t, device in ctx.kept]
        ctx.kept = None
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


def _to_host(t: torch.Tensor) -> torch.Tensor:
    with on_host():
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)
        return t.detach().clone()


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=True) if device.type == "cuda" else t.clone()
