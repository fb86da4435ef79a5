"""Which tensors autograd saves for each node, measured rather than guessed.

One forward on FakeTensors (no memory) runs under torch.autograd.graph.saved_tensors_hooks.
Every tensor the hooks see is attributed, by storage, to what made it:
  - the output of a graph node (placeholders included): saving it keeps that node's output alive;
  - a parameter or buffer: already resident, costs nothing extra;
  - nothing in the graph: a tensor made inside the node's own kernel or leaf module
    (LayerNorm's mean and rstd, dropout's mask, attention's softmax): extra memory held
    from the node's forward until its backward.
A recompute segment (passes/recompute/rewrite.py) keeps only its inputs; its own forward is recorded
separately, for the memory its backward allocates again. A selective segment also keeps the
outputs of the kernels its policy saves (segments.keeps_output), seen here as they run:
an attention node that runs as matmuls keeps its score matrices, not just its result.
The answer depends on the device the fakes claim (CPU and CUDA kernels save different things).
"""
from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS

from .aliases import storage_key
from .fake_state import fake_run
from .segments import SegmentCall, keeps_output


SAVES_NOTHING, SAVES_INPUTS, SAVES_OWN = 0, 1, 2


@dataclass(frozen=True)
class Saved:
    node: str        # the node whose backward needs the tensor
    source: str      # "node", "state" (parameter/buffer) or "internal"
    owner: str       # the node (or state name) whose storage it is; the saving node itself for internal ones
    storage: int     # identity of the storage, to count shared storages once
    nbytes: int      # bytes of the whole storage


@dataclass
class StepFacts:
    """What one recorded forward says about storages: who makes them and who keeps them."""

    storages: dict[str, list[tuple[int, int]]]   # node -> (storage, bytes) of every tensor in its output
    owner: dict[int, tuple[str, str]]            # storage -> ("node" | "state" | "internal", name)
    saved: dict[str, list[Saved]]                # node -> what its backward needs
    grad_bytes: dict[str, int]                   # node -> bytes of the gradient of its output
    segments: dict[str, "StepFacts"]             # recompute segment -> facts of its own forward
    policy_bytes: dict[str, int]                 # node -> bytes a selective segment keeps of it
    policy_storages: set[int]                    # the storages those bytes are
    policy_calls: dict[str, int]                 # node -> aten calls a selective segment's policy sees
    # nodes whose output is a view autograd tracks: a write into one makes autograd rebase its
    # base's history (CopySlices), whose backward copies the base's whole gradient
    tracked_views: set[str] = field(default_factory=set)

    def lifetimes(self, nodes: list[torch.fx.Node]) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
        """For each storage a node makes: (its maker's index in `nodes`, bytes); and for every
        storage, the index of the last node that makes, reads or returns it."""
        index = {n.name: i for i, n in enumerate(nodes)}
        made: dict[int, tuple[int, int]] = {}
        last: dict[int, int] = {}
        for n in nodes:
            for key, nbytes in self.storages.get(n.name, []):
                if self.owner.get(key) == ("node", n.name):
                    made.setdefault(key, (index[n.name], nbytes))
            for m in [n, *n.all_input_nodes]:
                for key, _ in self.storages.get(m.name, []):
                    last[key] = max(last.get(key, -1), index[n.name])
        return made, last

    def save_points(self, nodes: list[torch.fx.Node]) -> list[int]:
        """Per node, when its forward hands autograd what its backward needs: SAVES_NOTHING;
        SAVES_INPUTS, only what earlier nodes made or the model's state (autograd packs an
        op's inputs before its kernel runs); SAVES_OWN, a tensor it makes itself (its output,
        or one its kernel makes), packed after its kernel has run. A checkpoint's rerun stops
        once the last saved tensor is packed again (solver.rerun_end)."""
        points = []
        for n in nodes:
            items = self.saved.get(n.name, [])
            own = any(s.source == "internal" or (s.source == "node" and s.owner == n.name) for s in items)
            points.append(SAVES_OWN if own else SAVES_INPUTS if items else SAVES_NOTHING)
        return points

    def kept_and_live(self, nodes: list[torch.fx.Node]) -> tuple[list[int], list[int]]:
        """Per node: bytes it keeps for backward (its outputs that some backward needs, and what
        its own kernel saves), and bytes live across the gap after it (made by an earlier or
        this node, used by a later one). Inputs are left out: resident whatever a plan does."""
        index = {n.name: i for i, n in enumerate(nodes)}
        saved_storages = {s.storage for items in self.saved.values() for s in items if s.source == "node"}
        kept = [0] * len(nodes)
        for name, items in self.saved.items():
            if name in index:
                kept[index[name]] += sum({s.storage: s.nbytes for s in items if s.source == "internal"}.values())
        made, last_use = self.lifetimes(nodes)
        made = {key: (i, nbytes) for key, (i, nbytes) in made.items() if nodes[i].op != "placeholder"}
        delta = [0] * (len(nodes) + 1)  # a difference array over the gaps
        for key, (start, nbytes) in made.items():
            if key in saved_storages:
                kept[start] += nbytes
            end = last_use.get(key, start)
            if end > start:
                delta[start] += nbytes
                delta[end] -= nbytes
        live_after, running = [], 0
        for i in range(len(nodes)):
            running += delta[i]
            live_after.append(running)
        return kept, live_after


class _Recorder(torch.fx.Interpreter):
    """Runs the graph, remembering which node made each storage and keeping every tensor alive
    (a freed fake storage's address is reused, which would misattribute later tensors)."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        self.owner: dict[int, tuple[str, str]] = {}
        self.keep: list[torch.Tensor] = []
        self.current: torch.fx.Node | None = None
        self.saved: list[Saved] = []
        self.storages: dict[str, list[tuple[int, int]]] = {}
        self.grad_bytes: dict[str, int] = {}
        self.segments: dict[str, StepFacts] = {}
        self.policy_outputs: dict[str, dict[int, torch.Tensor]] = {}
        self.policy_calls: dict[str, int] = {}
        self.policy_mode: _PolicyOutputs | None = None
        self.tracked_views: set[str] = set()

    def run_node(self, n: torch.fx.Node):
        self.current = n
        first = len(self.saved)  # what n's forward saves is packed while it runs, after these
        out = super().run_node(n)
        if isinstance(n.target, SegmentCall):
            self._segment(n)
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in tensors:
            self.owner.setdefault(storage_key(t), ("node", n.name))
            self.keep.append(t)
        self.storages[n.name] = [(storage_key(t), t.untyped_storage().nbytes()) for t in tensors]
        self.grad_bytes[n.name] = sum(t.numel() * t.element_size() for t in tensors if t.requires_grad)
        if any(t.requires_grad and t._is_view() for t in tensors):
            self.tracked_views.add(n.name)
        # A kernel that saves its own result (relu, sigmoid, ...) does so before the result is
        # known as this node's output: that tensor is the output kept alive, not extra memory.
        mine = {key for key, _ in self.storages[n.name]}
        for i in range(first, len(self.saved)):
            saved = self.saved[i]
            if saved.node == n.name and saved.source == "internal" and saved.storage in mine:
                self.saved[i] = Saved(saved.node, "node", n.name, saved.storage, saved.nbytes)
                self.owner[saved.storage] = ("node", n.name)
        return out

    def _segment(self, n: torch.fx.Node):
        """checkpoint() hides the segment's saves behind its own hooks. It keeps the segment's
        inputs; its backward runs the segment again, recorded here as the segment's own facts."""
        for i in n.all_input_nodes:
            t = self.env[i]
            if isinstance(t, torch.Tensor) and t.requires_grad:
                self.pack(t)
        inner = _Recorder(n.target.module)
        inner.owner = {k: v for k, v in self.owner.items() if v[0] == "state"}
        inner.policy_mode = self.policy_mode
        self.policy_mode.recorder = inner
        try:
            with torch.autograd.graph.saved_tensors_hooks(_weak_pack(inner), _unpack):
                inner.run(*[self.env[i] if isinstance(i, torch.fx.Node) else i for i in n.args])
        finally:
            self.policy_mode.recorder = self
        self.segments[n.name] = inner.facts()
        self.keep.extend(inner.keep)
        if n.target.selective:  # what its policy keeps is held from the forward to its backward
            for outputs in inner.policy_outputs.values():
                for t in outputs.values():
                    self.pack(t)

    def facts(self) -> "StepFacts":
        saved: dict[str, list[Saved]] = {}
        for s in self.saved:
            saved.setdefault(s.node, []).append(s)
        policy_bytes = {name: sum(t.untyped_storage().nbytes() for t in outputs.values())
                        for name, outputs in self.policy_outputs.items()}
        policy_storages = {key for outputs in self.policy_outputs.values() for key in outputs}
        return StepFacts(self.storages, self.owner, saved, self.grad_bytes, self.segments, policy_bytes,
                         policy_storages, dict(self.policy_calls), self.tracked_views)

    def pack(self, t: torch.Tensor):
        if t.device.type == "meta" and not isinstance(t, FakeTensor):
            return t  # no memory: a fused call's stand-in for an input its backward does not read
        key = storage_key(t)
        source, owner = self.owner.get(key, ("internal", self.current.name))
        if source == "internal":
            self.owner[key] = ("internal", self.current.name)  # saved twice by one node: count it once
            self.keep.append(t)
        self.saved.append(Saved(self.current.name, source, owner, key, t.untyped_storage().nbytes()))
        return t


def _weak_pack(recorder: _Recorder):
    """The recorder's pack hook, holding it weakly: the fake step's autograd graph keeps its hooks, and the
    recorder keeps the graph's tensors, a cycle through C++ that Python's collector cannot see (it kept every
    recorded model, its parameters with it, for the life of the process)."""
    method = weakref.WeakMethod(recorder.pack)
    return lambda t: method()(t) if method() is not None else t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _PolicyOutputs(TorchDispatchMode):
    """Collects, per graph node, the outputs of the kernels a selective checkpoint keeps, and
    counts the calls its policy sees: every op below autograd but the metadata queries
    checkpoint leaves alone (a batch norm written in Python is several calls)."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        node = self.recorder.current
        if node is None or isinstance(node.target, SegmentCall) or func in SAC_IGNORED_OPS:
            return out
        self.recorder.policy_calls[node.name] = self.recorder.policy_calls.get(node.name, 0) + 1
        if keeps_output(func):
            kept = self.recorder.policy_outputs.setdefault(node.name, {})
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    kept.setdefault(storage_key(t), t)
        return out


def record_step(gm: torch.fx.GraphModule, flat_inputs: list, train: bool = True) -> StepFacts:
    """Run gm's forward once on FakeTensors and record storages and saved tensors (none when
    train is False: an inference forward runs without grad)."""

    recorder = _Recorder(gm)
    with fake_run(gm, flat_inputs) as (mode, inputs):
        for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
            recorder.owner.setdefault(storage_key(t), ("state", name))
        recorder.policy_mode = _PolicyOutputs(recorder)
        with torch.set_grad_enabled(train), torch.autograd.graph.saved_tensors_hooks(_weak_pack(recorder), _unpack), \
                recorder.policy_mode:
            recorder.run(*inputs)
    return recorder.facts()


def params_read(gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict[int, torch.nn.Parameter]:
    """The parameters a node reads, by storage: its leaf module's, or its get_attr inputs'."""
    if node.op == "call_module":
        tensors = list(gm.get_submodule(node.target).parameters())
    else:
        tensors = [operator.attrgetter(i.target)(gm) for i in node.all_input_nodes if i.op == "get_attr"]
    return {storage_key(t): t for t in tensors if isinstance(t, torch.nn.Parameter)}


def saved_tensors(gm: torch.fx.GraphModule, flat_inputs: list) -> dict[str, list[Saved]]:
    """For each node name, the tensors autograd saves for its backward."""
    return record_step(gm, flat_inputs).saved
