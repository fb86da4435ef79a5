"""Peak memory of one training step: predicted from the graph, and measured.

Bytes throughout; budget_gb's GB and its conversions are vocabulary/sizes.py's.

The step is the user's: forward, then backward from the scalar loss the model returns (or,
when it returns none, from every output with a gradient of its size), other outputs dropped;
with .grad None before (optimizer.zero_grad()'s default), or, with accumulate, with every
trainable parameter's .grad present (gradient accumulation after the first microbatch), which
backward adds into in place.
estimate_peak runs that step on FakeTensors under the instrument that measures a real one on
CPU (live_storage.py): every storage eager autograd allocates is counted, with the node of
the graph that made it. Only what no fake kernel shows is measured on a real sample (the
workspace of the RNN kernels) or sized as torch sizes it (cuBLAS's workspaces on CUDA).
measure_peak runs a real step: torch.cuda.max_memory_allocated on CUDA, live tensor storages
on CPU.
"""
from __future__ import annotations

import functools
import gc
import math
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import BudgetError
from ..vocabulary.sizes import GB, in_gb  # noqa: F401  (GB re-exported: read from here across the package)
from .cuda_workspaces import held_bytes
from .fake_state import fake_run
from .live_storage import LiveStorage
from .meta import tensor_info
from .optimizer_memory import OptimizerMemory
from .segments import recomputing
from .step_log import StepLog



def size_text(n: int) -> str:
    """Bytes in the unit that reads best, decimal as budgets are: 812 kB, 12.4 MB, 1.234 GB."""
    if abs(n) >= GB:
        return f"{n / GB:.3f} GB"
    if abs(n) >= 10**6:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.0f} kB"


def budget_text(n: int) -> str:
    """A budget_gb value of at least n bytes, in three significant digits (rounded up)."""
    gb = n / GB
    scale = 10 ** (math.floor(math.log10(gb)) - 2) if gb > 0 else 1
    return f"{math.ceil(gb / scale) * scale:.3g}"


# What else fits a step into less memory, for the refusals' advice.
SMALLER_STEP = "halve activations with precision='bf16', or split the model over devices with stages=N"


# On CPU the estimate counts what a measured step counts, storage by storage. On CUDA the
# allocator also holds what no tensor shows: cuBLAS and cuDNN workspaces, its rounding.
CUDA_HEADROOM = 0.05


def headroom(device: str) -> float:
    """The fraction of a budget a plan keeps free on the device for what its allocator holds
    beyond the estimate: a fact of the device the plan is for, asked here by every planner."""
    return CUDA_HEADROOM if device == "cuda" else 0.0


def held_to(limit: int, headroom: float) -> int:
    """The bytes a budget of `limit` holds the step's estimate to, its headroom kept free."""
    return int(limit * (1 - headroom))


def least_holding(nbytes: int, headroom: float) -> int:
    """The least budget that holds a step of nbytes with its headroom kept free (held_to's inverse,
    rounded up: a budget of exactly what a refusal names must fit)."""
    budget = math.ceil(nbytes / (1 - headroom))
    while held_to(budget, headroom) < nbytes:
        budget += 1
    return budget


def as_given(budget: int) -> str:
    """A budget as its user gave it and in bytes: 'budget_gb=0.3 (300 MB)'."""
    return f"budget_gb={in_gb(budget):g} ({size_text(budget)})"


def below_least(budget: int, least: int, needs: str, breakdown: dict, advice: str = SMALLER_STEP,
                headroom: float = 0.0) -> BudgetError:
    """The refusal of a budget under the least a step needs: the budget, the least and what needs
    it ("one training step needs at least, by the estimate"), its parts, the budget that works in
    budget_gb's own unit, then advice: what else would fit. headroom: the fraction of the budget
    kept free above the step's peak, in the least (CUDA's)."""
    parts = {k: v for k, v in breakdown.items() if v}
    detail = f" ({', '.join(f'{k} {size_text(v)}' for k, v in parts.items())})" if parts else ""
    kept = headroom_text(least, headroom)
    return BudgetError(
        f"{as_given(budget)} is below the {size_text(least)} that "
        f"{needs}{detail}{', ' + kept if kept else ''}. Raise budget_gb to {budget_text(least)} or more, {advice}.",
        min_budget_bytes=least, breakdown=parts, headroom=headroom, budget_bytes=budget)


def headroom_text(budget: int, headroom: float) -> str:
    """'a step of 1.234 GB and the 5% of the budget kept free for what the allocator holds beyond
    the estimate', or "" without headroom."""
    if not headroom:
        return ""
    return (f"a step of {size_text(int(budget * (1 - headroom)))} and the {headroom:.0%} of the budget kept free "
            "for what the allocator holds beyond the estimate")


@dataclass
class Estimate:
    peak_bytes: int
    breakdown: dict[str, int]  # live bytes by category at the peak
    timeline: list[tuple[str, int]] = field(default_factory=list)  # (event, live bytes) through the step
    # Per graph node, the most its backward holds besides activations, parameters and their
    # gradients: the gradients in flight (those it makes for its inputs, and those made before
    # it and not yet used) and its kernels' temporaries. A pipeline stage's largest is part of
    # its memory.
    backward_work: dict[str, int] = field(default_factory=dict)
    log: StepLog | None = None  # every storage's position in the step (step_log.py)

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / GB


def output_tensors(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes whose tensors the graph returns, looking through containers it builds
    (a dataclass or dict constructed in the graph is a node without tensor metadata)."""
    found, stack, seen = [], list(gm.graph.output_node().all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if tensor_info(n) is not None:
            found.append(n)
        elif n.op == "call_function":
            stack.extend(n.all_input_nodes)
    return found


def backward_roots(out) -> list[torch.Tensor]:
    """The outputs one training step backpropagates from: its scalar losses (a model that
    computes its loss, as transformers' do with labels) when it returns any, else every
    floating output that requires grad (a loss computed outside, whose gradient is the
    output's size)."""
    from .trial import tensor_leaves

    leaves = [t for t in tensor_leaves(out) if t.requires_grad and t.is_floating_point()]
    losses = [t for t in leaves if t.dim() == 0]
    return losses or leaves


def estimate_peak(gm: torch.fx.GraphModule, flat_inputs: list, *, train: bool = True,
                  optimizer: OptimizerMemory | None = None, accumulate: bool = False,
                  host_gradients: bool = False) -> Estimate:
    """Predicted peak bytes of one training step of gm on the example inputs: forward, then
    backward from backward_roots; with train=False, of a forward without grad.

    The step runs on FakeTensors, which allocate nothing, under the instrument that measures
    a real one (LiveStorage): what autograd saves, the gradients it makes, accumulates and
    copies, each backward kernel's temporaries, a recompute segment's rerun and an opaque op's
    workspace are what the real step allocates, not a model of it.

    optimizer: its state is resident through the step, and its step() runs after backward,
    while every gradient is alive (analysis/optimizer_memory.py).
    accumulate: every trainable parameter's gradient is resident from the start, and backward
    adds into it; else none is (whatever .grad the real parameters hold now).
    host_gradients: each gradient leaves the device as soon as backward has made it (analysis/
    host_step.py: copied to the host), and none is resident from the start, accumulating or not.
    """

    with fake_run(gm, flat_inputs) as (mode, inputs):
        tracker = traced_step(gm, inputs, mode, train=train, optimizer=optimizer, accumulate=accumulate,
                              host_gradients=host_gradients)
    return Estimate(tracker.peak, tracker.at_peak, tracker.timeline, tracker.work, tracker.step_log())


def traced_step(gm: torch.fx.GraphModule, inputs: list, mode, *, train: bool = True,
                optimizer: OptimizerMemory | None = None, accumulate: bool = False,
                host_gradients: bool = False) -> "_StepTracker":
    """estimate_peak's step of gm on `inputs` under `mode` (a fake_run's FakeTensorMode, or a
    null context for a real step), in its instrument, which it returns."""
    params = list(gm.parameters())
    tracker = _StepTracker(recomputing, threads=2 if train else 1)
    tracker.add(params, "parameters")
    with mode:
        tracker.add(_set_gradients(params, present=accumulate and train and not host_gradients), "parameter gradients")
    tracker.add(list(gm.buffers()), "buffers")
    tracker.add([v for v in inputs if isinstance(v, torch.Tensor)], "inputs")
    if optimizer is not None:
        tracker.add_bytes("optimizer state", optimizer.state_bytes, "optimizer state")
    hooks = [p.register_post_accumulate_grad_hook(tracker.parameter_gradient)
             for p in params if p.requires_grad] if train else []
    hooks += gradients_to_host(params) if train and host_gradients else []
    try:
        with mode, tracker, torch.set_grad_enabled(train):
            # Only the roots outlive the forward, as in `model(x).loss.backward()`.
            out = _Forward(gm, tracker).run(*inputs)
            roots = backward_roots(out) if train else []
            del out
            tracker.log.forward_end = tracker.changes
            if roots:
                tracker.phase = "backward"
                torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
            if roots and optimizer is not None:
                tracker.add_bytes("optimizer step", optimizer.step_bytes, "optimizer step")
                tracker.add_bytes("optimizer step", -optimizer.step_bytes, "optimizer step done")
    finally:
        for h in hooks:
            h.remove()
    return tracker


def predict_peak(run, mode, resident: list, optimizer: OptimizerMemory | None = None,
                 host_gradients: list | None = None) -> int:
    """Peak bytes of run(), a step on FakeTensors of `mode` (fake_state.fake_run) beyond what a
    graph holds (a loss computed outside it, say), with `resident` alive throughout and, with
    an optimizer, its state and its step after run(): estimate_peak's instrument, for a
    caller's own step. host_gradients: the parameters whose gradients leave the device as
    backward makes them."""
    tracker = _StepTracker(recomputing)
    tracker.add(resident, "resident")
    if optimizer is not None:
        tracker.add_bytes("optimizer state", optimizer.state_bytes, "optimizer state")
    hooks = gradients_to_host(host_gradients or [])
    try:
        with mode, tracker:
            run()
            if optimizer is not None:
                tracker.add_bytes("optimizer step", optimizer.step_bytes, "optimizer step")
    finally:
        for h in hooks:
            h.remove()
    return tracker.peak


def gradients_to_host(params: list) -> list:
    """Hooks that take each trainable parameter's gradient off the device once backward has made
    it, as the host step's runtime copies it out (runtime/host_optimizer.py): the handles."""
    def gone(p):
        p.grad = None

    return [p.register_post_accumulate_grad_hook(gone) for p in params if p.requires_grad]


def _set_gradients(params: list, present: bool) -> list[torch.Tensor]:
    """Give each trainable parameter a gradient (uninitialized: only its storage matters) when
    present, else none; the gradients given."""
    grads = []
    for p in params:
        p.grad = torch.empty_like(p) if present and p.requires_grad else None
        if p.grad is not None:
            grads.append(p.grad)
    return grads


class _StepTracker(LiveStorage):
    """LiveStorage naming each storage by the part of the step that makes it: a graph node's
    forward, its backward, a segment's rerun in backward, a parameter's gradient."""

    def __init__(self, recomputing, threads: int = 2):
        super().__init__(timeline=True)
        self.recomputing = recomputing
        self.threads = threads  # that run cuBLAS: the forward's, and autograd's when the step has a backward
        self.workspaces = 0
        self.phase, self.node = "forward", ""
        self.work: dict[str, int] = {}
        self._running = None  # the graph node whose backward runs
        self.log = StepLog()

    def step_log(self) -> StepLog:
        """The log, with each position's change, once the step has run."""
        self.log.finish(self.timeline, self.storages)
        return self.log

    def where(self) -> tuple[str, str]:
        if self.phase == "forward":
            return "activations", f"forward {self.node}"
        current = torch._C._current_autograd_node()
        made_by = None if current is None else current.metadata.get(_MADE_BY)
        name = made_by or ("" if current is None else current.name())
        self._running = made_by
        if self.recomputing():
            return "recomputed", f"recompute {name}"
        return "gradients", f"backward {name}"

    def _change(self, category: str, nbytes: int, event: str) -> None:
        super()._change(category, nbytes, event)
        if self.phase == "backward" and self._running is not None and nbytes > 0:
            flight = self.by_category.get("gradients", 0) + self.by_category.get("recomputed", 0)
            self.work[self._running] = max(self.work.get(self._running, 0), flight)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.workspaces:  # held from the first product on (a step after the first: from its start)
            self.workspaces = held_bytes(func, args, self.threads)
            if self.workspaces:
                self.add_bytes("cuBLAS workspaces", self.workspaces, "cuBLAS workspaces")
        return super().__torch_dispatch__(func, types, args, kwargs)

    def parameter_gradient(self, p: torch.Tensor) -> None:
        self.recategorize(p.grad, "parameter gradients")

    def sizes(self, func, args, kwargs, out):
        if func not in _FAKE_WORKSPACE or not isinstance(out[0], FakeTensor):
            return super().sizes(func, args, kwargs, out)
        return _measured_sizes(func, args, kwargs)


# Kernels whose fake implementation returns an empty workspace or reserve that the real
# kernel fills (an LSTM's gates for its backward): their outputs are measured instead.
_FAKE_WORKSPACE = {torch.ops.aten.mkldnn_rnn_layer.default, torch.ops.aten._cudnn_rnn.default,
                   torch.ops.aten.miopen_rnn.default}


def _measured_sizes(func, args, kwargs) -> list[int]:
    """Output bytes of one real run of func on zeros of the same shapes, once per signature."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    shapes = tuple((tuple(t.shape), t.dtype, str(t.device)) for t in tensors)
    others = repr(pytree.tree_map_only(torch.Tensor, lambda t: None, (args, kwargs)))

    key = (func, shapes, others)
    if key not in _MEASURED:
        with _disable_current_modes():
            real_args, real_kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=t.device), (args, kwargs))
            out = func(*real_args, **real_kwargs)
            _MEASURED[key] = [t.untyped_storage().nbytes() for t in pytree.tree_leaves(out)
                              if isinstance(t, torch.Tensor)]
    return _MEASURED[key]


_MEASURED: dict = {}


_MADE_BY = "graphopt_node"


class _Forward(torch.fx.Interpreter):
    """Runs the graph, freeing each value after its last use as the generated code does, and
    tells the tracker which node runs; each autograd node it makes is tagged with the graph
    node (in its metadata: a reference would keep an unused output's saved tensors alive)."""

    def __init__(self, gm: torch.fx.GraphModule, tracker: _StepTracker):
        super().__init__(gm)
        self.tracker = tracker

    def run_node(self, n: torch.fx.Node):
        tracker, log = self.tracker, self.tracker.log
        tracker.node = n.name
        log.forward_start[n.name] = tracker.changes
        out = super().run_node(n)
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        made = f"forward {n.name}"
        log.outputs[n.name] = [s for s in map(tracker.serial, tensors) if s is not None and tracker.storages[s].event == made]
        # Every autograd node this graph node made, not just its output's: a leaf module or
        # a composite op (linear's addmm under its view) makes several.
        stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or _MADE_BY in fn.metadata or type(fn).__name__ == "AccumulateGrad":
                continue
            fn.metadata[_MADE_BY] = n.name
            # a pre-hook only: a post-hook makes the engine hold the incoming gradients longer
            fn.register_prehook(functools.partial(_started, tracker, n.name))
            stack.extend(f for f, _ in fn.next_functions)
        return out


def _started(tracker: "_StepTracker", name: str, grad_outputs) -> None:
    tracker.log.backward_node_started(name, tracker.changes)


def measure_peak(fn, *track) -> int:
    """Peak bytes live while fn() runs, counting the modules and tensors in `track` as resident.

    On CUDA: torch.cuda.max_memory_allocated (everything on the device). On CPU: the bytes of
    live tensor storages (LiveStorage).
    """
    tensors = [t for t in pytree.tree_leaves(list(track)) if isinstance(t, torch.Tensor)]
    modules = [m for m in track if isinstance(m, torch.nn.Module)]
    devices = {t.device for t in tensors} | {p.device for m in modules for p in m.parameters()}
    if any(d.type == "cuda" for d in devices):
        gc.collect()  # a dropped GraphModule is a cycle: until collected its tensors count in this peak
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    resident = tensors + [t for m in modules for t in (*m.parameters(), *m.buffers())]
    resident += [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    with LiveStorage(resident) as live:
        fn()
    return live.peak


def measure_step(module: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
                 accumulate: bool = False) -> int:
    """Measured peak bytes of one training step of `module`: forward, then backward from
    backward_roots (with ones as their gradients), the step estimate_peak predicts, with .grad
    None before or, with accumulate, present (zeros). Gradients are cleared after."""
    kwargs = kwargs or {}
    for p in module.parameters():
        p.grad = torch.zeros_like(p) if accumulate and p.requires_grad else None

    def step():
        roots = backward_roots(module(*args, **kwargs))
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])

    try:
        return measure_peak(step, module, *args, *kwargs.values())
    finally:
        for p in module.parameters():
            p.grad = None
