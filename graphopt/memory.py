"""Peak memory of one training step: predicted from the graph, and measured.

GB means 10**9 bytes everywhere in graphopt (budget_gb=8 is 8e9 bytes).

estimate_peak walks the step the way eager autograd runs it, counting each storage once
(storages and saved tensors come from one recorded FakeTensor forward, saved.py):
  forward   in graph order, a node's new output storages are allocated, with the tensors its
            kernel saves for backward; a storage is freed after its last use unless a
            backward still needs it or it is a graph output;
  backward  in reverse order, a node's backward needs the gradient of its output, one
            workspace of that size, and makes gradients for its inputs; parameter gradients
            stay, the rest and the node's saved tensors are freed once its backward has run.
measure_peak runs a real step: torch.cuda.max_memory_allocated on CUDA, live tensor storages
(live_storage.py) on CPU.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.utils._pytree as pytree

from .live_storage import LiveStorage
from .meta import tensor_info
from .saved import StepFacts, record_step, storage_key

GB = 10**9


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


@dataclass
class Estimate:
    peak_bytes: int
    breakdown: dict[str, int]  # live bytes by category at the peak
    timeline: list[tuple[str, int]] = field(default_factory=list)  # (event, live bytes) through the step

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / GB


class _Live:
    """Live bytes by category; the peak is kept with the breakdown at that moment."""

    def __init__(self):
        self.bytes: dict[str, int] = {}
        self.peak, self.at_peak, self.timeline = 0, {}, []

    def add(self, category: str, n: int, event: str):
        if n == 0:
            return
        self.bytes[category] = self.bytes.get(category, 0) + n
        total = sum(self.bytes.values())
        self.timeline.append((event, total))
        if total > self.peak:
            self.peak, self.at_peak = total, dict(self.bytes)


def budget_at(estimate: Estimate, f: float) -> float:
    """The budget in GB that keeps parameters and gradients and f of the rest of the step's peak."""
    fixed = 2 * estimate.breakdown.get("parameters", 0)
    return (fixed + f * (estimate.peak_bytes - fixed)) / GB


def output_tensors(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes whose tensors the graph returns, looking through containers it builds
    (a dataclass or dict constructed in the graph is a node without tensor metadata)."""
    found, stack, seen = [], list(next(reversed(gm.graph.nodes)).all_input_nodes), set()
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


def estimate_peak(gm: torch.fx.GraphModule, flat_inputs: list, *, train: bool = True,
                  optimizer_state_bytes: int = 0) -> Estimate:
    """Predicted peak bytes of forward + backward of gm's outputs, on the example inputs; with
    train=False, of a forward without grad (nothing saved, no gradients).

    optimizer_state_bytes: resident optimizer state (e.g. 2x parameter bytes for Adam).
    """
    facts = record_step(gm, flat_inputs, train)
    live = _Live()
    live.add("parameters", sum(p.untyped_storage().nbytes() for p in gm.parameters()), "parameters")
    live.add("buffers", sum(b.untyped_storage().nbytes() for b in gm.buffers()), "buffers")
    live.add("optimizer state", optimizer_state_bytes, "optimizer state")
    _simulate(gm, facts, live, set(), backward=train)
    return Estimate(live.peak, live.at_peak, live.timeline)


def _simulate(gm: torch.fx.GraphModule, facts: StepFacts, live: _Live, param_grads: set[int],
              segment: bool = False, backward: bool = True) -> None:
    """Forward then backward of gm. For a recompute segment (segment=True) its inputs are
    already resident, the gradients of its inputs and outputs belong to the caller, and its
    outputs are not held: the recompute keeps only what the segment's backward needs."""
    nodes = list(gm.graph.nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    made, last_use = facts.lifetimes(nodes)
    size = {key: nbytes for key, (_, nbytes) in made.items()}  # storages graph nodes make
    needed_by: dict[int, set[str]] = {}  # storage -> nodes whose backward still needs it
    internal: dict[str, int] = {}
    for name, items in facts.saved.items():
        for s in {s.storage: s for s in items}.values():
            if s.source == "node":
                needed_by.setdefault(s.storage, set()).add(name)
            elif s.source == "internal":
                internal[name] = internal.get(name, 0) + s.nbytes
    returned = output_tensors(gm)
    held = set() if segment else {key for m in returned for key, _ in facts.storages.get(m.name, [])}
    placeholders = {n.name for n in nodes if n.op == "placeholder"}

    def free(key: int, event: str):
        if size.get(key) and key not in held and not needed_by.get(key):
            live.add("activations", -size[key], event)
            size[key] = 0

    # Forward
    for n in nodes:
        if n.op == "output" or (segment and n.op == "placeholder"):
            continue
        category = "inputs" if n.op == "placeholder" else "activations"
        new = [k for k, _ in facts.storages.get(n.name, []) if facts.owner.get(k) == ("node", n.name)]
        live.add(category, sum(size[k] for k in dict.fromkeys(new)) + internal.get(n.name, 0), f"forward {n.name}")
        for m in [n, *n.all_input_nodes]:
            for key, _ in facts.storages.get(m.name, []):
                owner = facts.owner[key]
                if last_use.get(key) == index[n.name] and owner[0] == "node" and owner[1] not in placeholders:
                    free(key, f"free {owner[1]}")

    if not backward:
        return
    # Backward: gradients of the outputs, then each node's backward in reverse graph order.
    grads: dict[str, int] = {}
    for m in returned:
        if facts.grad_bytes.get(m.name, 0) and not (segment and m.op == "placeholder"):
            grads[m.name] = facts.grad_bytes[m.name]
            if not segment:
                live.add("gradients", grads[m.name], f"grad of output {m.name}")
    callers = set(grads) if segment else set()
    for n in reversed(nodes):
        if n.name not in grads or n.op in ("placeholder", "get_attr"):
            continue
        if n.name in facts.segments:  # runs its forward again, then its own backward
            if n.target.selective:  # what it kept passes to the rerun, which frees it as it goes
                live.add("activations", -internal.pop(n.name, 0), f"backward {n.name}: kept outputs to the rerun")
            inner = _Live()
            _simulate(n.target.module, facts.segments[n.name], inner, param_grads, True)
            live.add("recomputed", inner.peak, f"backward {n.name}: recompute and backward")
            live.add("recomputed", -inner.peak, f"backward {n.name}: done")
            live.add("parameter gradients", inner.bytes.get("parameter gradients", 0), f"backward {n.name}: parameter gradients")
        for m in n.all_input_nodes:
            if m.name not in grads and facts.grad_bytes.get(m.name, 0) and m.op != "get_attr" \
                    and not (segment and m.op == "placeholder"):
                grads[m.name] = facts.grad_bytes[m.name]
                live.add("gradients", grads[m.name], f"backward {n.name}: grad of {m.name}")
        for p in _params_used(gm, n):
            key = storage_key(p)
            if key not in param_grads:
                param_grads.add(key)
                live.add("parameter gradients", p.untyped_storage().nbytes(), f"backward {n.name}: parameter gradient")
        # Most backward kernels build one temporary the size of the incoming gradient
        # (f'(x) before the multiply, the recomputed softmax, ...), freed when they return.
        live.add("transient", grads[n.name], f"backward {n.name}: workspace")
        live.add("transient", -grads[n.name], f"backward {n.name}: workspace freed")
        if n.name not in callers:
            live.add("gradients", -grads[n.name], f"backward {n.name} done")
        live.add("activations", -internal.get(n.name, 0), f"free saved by {n.name}")
        for s in {s.storage: s for s in facts.saved.get(n.name, []) if s.source == "node"}.values():
            needed_by[s.storage].discard(n.name)
            free(s.storage, f"free {s.owner}")


def _params_used(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[torch.nn.Parameter]:
    """Trainable parameters a node reads: its module's own, or get_attr inputs."""
    if node.op == "call_function" and hasattr(node.target, "module"):  # a recompute segment
        return []  # counted by the segment's own simulation
    if node.op == "call_module":
        return [p for p in gm.get_submodule(node.target).parameters() if p.requires_grad]
    attrs = [operator.attrgetter(m.target)(gm) for m in node.all_input_nodes if m.op == "get_attr"]
    return [a for a in attrs if isinstance(a, torch.nn.Parameter) and a.requires_grad]


def measure_peak(fn, *track) -> int:
    """Peak bytes live while fn() runs, counting the modules and tensors in `track` as resident.

    On CUDA: torch.cuda.max_memory_allocated (everything on the device). On CPU: the bytes of
    live tensor storages (LiveStorage).
    """
    tensors = [t for t in pytree.tree_leaves(list(track)) if isinstance(t, torch.Tensor)]
    modules = [m for m in track if isinstance(m, torch.nn.Module)]
    devices = {t.device for t in tensors} | {p.device for m in modules for p in m.parameters()}
    if any(d.type == "cuda" for d in devices):
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


def measure_step(module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> int:
    """Measured peak bytes of one training step of `module`: forward, then backward of every
    floating output that requires grad (with ones as its gradient). Gradients are cleared after."""
    from .verify import tensor_leaves

    kwargs = kwargs or {}

    def step():
        leaves = [t for t in tensor_leaves(module(*args, **kwargs)) if t.requires_grad and t.is_floating_point()]
        torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])

    try:
        return measure_peak(step, module, *args, *kwargs.values())
    finally:
        for p in module.parameters():
            p.grad = None
