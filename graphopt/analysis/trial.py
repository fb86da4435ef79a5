"""Runs that leave no trace: a module run for a measurement or a comparison, with its
gradients, buffers, the inputs' values and gradients and the RNG put back afterwards."""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.utils._pytree as pytree


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module):
    """Save and restore parameter grads and buffer values around trial runs."""
    grads = [(p, p.grad) for p in module.parameters()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        for p, _ in grads:
            p.grad = None
        yield
    finally:
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
        for p, g in grads:
            p.grad = g


class Snapshot:
    """The values of some tensors, to put back those written since (by their version counters)."""

    def __init__(self, tensors):
        self.saved = [(t, t._version, t.detach().clone()) for t in tensors]

    def restore(self) -> list[torch.Tensor]:
        """Copy back every tensor written since the snapshot; return those."""
        written = [(t, value) for t, version, value in self.saved if t._version != version]
        with torch.no_grad():
            for t, value in written:
                t.copy_(value)
        return [t for t, _ in written]


@contextlib.contextmanager
def preserved_inputs(inputs):
    """Save and restore the gradients and values of the input tensors around trial runs: an
    input that requires grad collects one, and a forward may write into its inputs."""
    tensors = list({id(t): t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)}.values())
    grads, values = [(t, t.grad) for t in tensors if t.is_leaf], Snapshot(tensors)
    try:
        yield
    finally:
        values.restore()
        for t, grad in grads:
            t.grad = grad


@contextlib.contextmanager
def trial_run(module: torch.nn.Module, inputs=()):
    """Run `module` for a measurement and leave no trace: gradients and buffers (preserved_state),
    the input tensors' gradients and values (preserved_inputs), and the RNG of the CPU and of
    the CUDA devices `inputs` are on, as they were."""
    with preserved_state(module), preserved_inputs(inputs), torch.random.fork_rng(devices=_devices(inputs, {})):
        yield


def tensor_leaves(value) -> list[torch.Tensor]:
    """Every tensor in an output: containers pytree knows, and dataclasses it may not."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in tensor_leaves(getattr(value, f.name))]
    if isinstance(value, torch.Tensor):
        return [value]
    leaves = pytree.tree_leaves(value)
    if len(leaves) == 1 and leaves[0] is value:
        return []
    return [t for leaf in leaves for t in tensor_leaves(leaf)]


def _devices(args, kwargs) -> list:
    return sorted({t.device.index or 0 for t in pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
