"""A training step captured as CUDA graphs: the optimized graph's forward and backward, replayed.

0. optimize(cuda_graphs=True) refuses first what no capture holds: no example inputs, stages,
   shard, inference (check_cuda_graphs); after the passes, a step that waits on the device or
   reruns a segment that draws random numbers (analysis/cuda_graphs.py), a model off CUDA.
1. At optimize(), for the example's call signature: the call's tensors are flattened (its other
   arguments are the signature's, fixed), and a module without hooks that puts the call back
   together and runs the graph's forward is handed to torch.cuda.make_graphed_callables: warm-up
   steps on a side stream (the fused kernels compile and bind their launchers there), then the
   forward and the backward captured into one memory pool. What the warm-up changed (buffers,
   gradients, the RNG) is put back (trial_run).
2. A call passes the module's checks on the host first (runtime/guards.py); a call of the
   captured signature (its tensors' shapes, dtypes, devices and requires_grad), in training mode
   with grad enabled, copies its tensors into the graph's static inputs and replays; any other
   call runs the graph uncaptured. A parameter or buffer replaced or moved since the capture (a new
   tensor, or new memory: not one written in place, as an optimizer's step writes) is refused: the
   graphs read and write the old memory.
3. What a replay returns lives in the graphs' static buffers: the next call overwrites it, as
   torch.compile's CUDA graphs do (clone what you keep across steps).
"""
from __future__ import annotations

import functools

import torch
import torch.utils._pytree as pytree

from ..analysis.cuda_graphs import graphs_reserve, host_syncs, random_reruns
from ..analysis.memory import size_text
from ..analysis.meta import graph_device
from ..analysis.trial import trial_run
from ..errors import OptionError, UsageError
from .guards import describe_call

WARMUP_STEPS = 3  # before the capture: what runs once only (compiling, binding, cuBLAS's workspaces) runs there


def _signature(tensors) -> tuple:
    """What a replay assumes of the call's tensors (their class too: a FakeTensor step of the same
    sizes, an estimate's, runs the graph uncaptured)."""
    return tuple((type(t), t.shape, t.dtype, t.device, t.requires_grad) for t in tensors)


class _Call(torch.nn.Module):
    """The graph's forward over the call's tensors alone: what make_graphed_callables takes. The
    graph is a child, so its parameters are this module's (their gradients come from the capture)."""

    def __init__(self, gm: torch.fx.GraphModule, forward, leaves: list, spec, places: list):
        super().__init__()
        self.gm, self._forward, self._leaves, self._spec, self._places = gm, forward, leaves, spec, places
        self.train(gm.training)

    def forward(self, *tensors):
        leaves = list(self._leaves)
        for at, t in zip(self._places, tensors):
            leaves[at] = t
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        return self._forward(self.gm, *args, **kwargs)


class CapturedStep:
    """Step 1: the graphs of gm's training step at the call (args, kwargs)."""

    def __init__(self, gm: torch.fx.GraphModule, forward, args: tuple, kwargs: dict):
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        self.places = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        tensors = [leaves[i] for i in self.places]
        self.signature = _signature(tensors)
        # every parameter and buffer where its module holds it, and its memory: the graphs read and write there
        self.state = [(held, name, t, t.data_ptr()) for m in gm.modules() for held in (m._parameters, m._buffers)
                      for name, t in held.items() if t is not None]
        call = _Call(gm, forward, leaves, self.spec, self.places)
        try:
            with trial_run(gm, (args, kwargs)):
                self.graphed = torch.cuda.make_graphed_callables(call, tuple(tensors), num_warmup_iters=WARMUP_STEPS)
        except (RuntimeError, AssertionError) as e:
            raise UsageError(f"cuda_graphs=True: capturing the optimized step as CUDA graphs failed: {e}. Optimize "
                             "without cuda_graphs, or with passes that leave out what the capture refused.") from e

    def tensors(self, args: tuple, kwargs: dict) -> list | None:
        """The call's tensors where it is of the captured signature; else None."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.spec or len(leaves) < len(self.places):
            return None
        tensors = [leaves[i] for i in self.places]
        if not all(isinstance(t, torch.Tensor) for t in tensors) or _signature(tensors) != self.signature:
            return None
        return tensors

    def __call__(self, tensors: list):
        for held, name, t, address in self.state:
            if held.get(name) is not t or t.data_ptr() != address:
                raise UsageError(f"this graphopt module replays its training step as CUDA graphs (cuda_graphs=True), "
                                 f"which read the parameters and buffers it was captured with where they were, and "
                                 f"{name!r} has been replaced or moved since (written in place, as an optimizer's step "
                                 "writes, is fine): optimize again.")
        return self.graphed.forward(*tensors)


def install_cuda_graphs(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> CapturedStep:
    """Steps 1 and 2: capture gm's step at (args, kwargs); its calls of that signature replay it."""
    plain = type(gm).forward
    captured = CapturedStep(gm, plain, args, kwargs)

    @functools.wraps(plain)  # the signature stays the graph's: placeholder_values binds calls by it
    def forward(self, *call_args, **call_kwargs):
        if self.training and torch.is_grad_enabled():
            tensors = captured.tensors(call_args, call_kwargs)
            if tensors is not None:
                return captured(tensors)
        return plain(self, *call_args, **call_kwargs)

    type(gm).forward = forward
    return captured


def check_cuda_graphs(value, lazy: bool, stages, shard, train: bool) -> None:
    """optimize()'s cuda_graphs= against its other arguments, before anything is traced."""
    if not isinstance(value, bool):
        raise OptionError(f"cuda_graphs must be True or False, got {value!r}.")
    if not value:
        return
    if lazy:
        raise OptionError("cuda_graphs=True captures the step at the example's signature: give example inputs, "
                          "graphopt.optimize(model, example_inputs, cuda_graphs=True).")
    if stages is not None:
        raise OptionError("cuda_graphs=True captures one device's step, and stages= runs the step as a pipeline of "
                          "microbatches: give one of them.")
    if shard is not None:
        raise OptionError("cuda_graphs=True with shard=: FSDP2 gathers and frees each unit's parameters with "
                          "collectives and hooks a CUDA graph capture does not record: give one of them.")
    if not train:
        raise OptionError("cuda_graphs=True captures a training step's forward and backward; this graph is built for "
                          "inference (train=False, or a model in eval mode): leave cuda_graphs out.")


def capture(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, ctx) -> str:
    """Refuse a step a capture cannot hold (analysis/cuda_graphs.py), or capture it (install_cuda_graphs);
    the report's line."""
    syncs = host_syncs(gm)
    if syncs:
        named = "; ".join(f"{name}: {why}" for name, why in list(syncs.items())[:4])
        raise UsageError(f"cuda_graphs=True: the step waits for the device where the host reads a value back "
                         f"({named}), which a CUDA graph capture cannot record. Leave cuda_graphs out, or keep "
                         "such reads out of the model's forward (compute on the device, e.g. torch.where).")
    reruns = random_reruns(gm)
    if reruns:
        raise UsageError(f"cuda_graphs=True: recompute segments {', '.join(reruns)} draw random numbers, and their "
                         "rerun restores the CUDA RNG state, which a capture does not record. Give a budget that "
                         "needs no segment across dropout, set the model's dropout to 0, or leave cuda_graphs out.")
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    elsewhere = sorted({str(t.device) for t in [*tensors, *gm.parameters()] if t.device.type != "cuda"})
    if elsewhere or graph_device(gm) != "cuda":
        raise UsageError(f"cuda_graphs=True needs the model and its example inputs on CUDA; some are on "
                         f"{', '.join(elsewhere) or graph_device(gm)}. Move them there (model.cuda(), x.cuda()) or "
                         "leave cuda_graphs out.")
    install_cuda_graphs(gm, args, kwargs)
    held = graphs_reserve(gm, ctx.flat_inputs(gm))
    return (f"forward and backward captured at {describe_call(args, kwargs)} (other calls run uncaptured); besides the "
            f"step they hold {size_text(held)} of static inputs and gradients")
