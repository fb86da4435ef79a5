"""A rank's peak memory through one FSDP2 training step, predicted before any device is used.

1. A copy of the graph whose parameters and buffers are FakeTensors (analysis/fake_state.fake_copy:
   nothing real is copied) has its units sharded as the user shards them
   (runtime/fsdp.fully_shard_units) over a fake process group of world_size ranks, whose
   collectives move nothing but allocate what real ones allocate.
2. The step runs twice on fake inputs: forward, backward from the loss (for gradient
   accumulation, twice, the second into the sharded gradients the first left: a microbatch after
   the first), the optimizer's step, gradients set to None; the second, with the optimizer's
   state made, under torch's FSDPMemTracker, which counts what a rank holds at each moment: its
   shard of the parameters, gradients and optimizer state, the gathered parameters of the unit
   that runs and of the one prefetched, the all-gather and reduce-scatter buffers, activations
   and what recompute reruns.
3. What the tracker cannot see: a collective runs asynchronously, and its backend may keep the
   input of a unit's reduce-scatter alive after FSDP2 drops it, while the next unit's is made
   (gloo does, on some ranks). The slack is the largest unit's reduce-scatter input; a plan for
   a rank's budget holds the peak plus it.
torchtitan estimates its steps' memory so. Allocator effects (CUDA's block rounding) are not in it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.modules.module import register_module_forward_pre_hook

from ...analysis.fake_kernels import active as fake_kernels_active
from ...analysis.fake_state import fake_copy
from ...analysis.memory import backward_roots
from ...analysis.optimizer_memory import optimizer_over
from ...errors import UsageError
from ...runtime.fsdp import fully_shard_units, unit_modules
from .units import make_units

ESTIMATE_DIM = "graphopt_rank_estimate"  # the fake mesh's dimension (_fake_mesh)
# what else lowers a rank's step, where a budget is below its least
RANK_ADVICE = ("halve activations with precision='bf16', or shard over more ranks (world_size); the host tier "
               "(FSDP2's CPUOffloadPolicy, the optimizer's state and step on the host) is not planned per rank")


@dataclass(frozen=True)
class RankPeak:
    peak_bytes: int
    breakdown: dict[str, int]  # FSDPMemTracker's categories at the peak (parameters, gradients, buffers, ...)
    slack_bytes: int = 0  # step 3: one unit's reduce-scatter input a backend may still hold

    @property
    def bound_bytes(self) -> int:
        """What a plan holds to the budget: the peak and the slack."""
        return self.peak_bytes + self.slack_bytes


def rank_peak(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, world_size: int, optimizer=None, *,
              accumulate: bool = False, loss: Callable | None = None) -> RankPeak:
    """One rank's peak through a training step of gm under FSDP2 over world_size ranks: gm's
    units (the shard pass's, made on the copy where gm has none yet: the recompute pass asks
    before the shard pass runs); optimizer: None (forward and backward only), a name in NAMED or a
    torch.optim.Optimizer (its class and settings); accumulate: the step's microbatches add into
    the sharded gradients (train_step's); loss(module, args, kwargs): the scalar backpropagated
    (a loss outside the graph), by default the graph's losses (memory.backward_roots)."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    model, (args, kwargs) = fake_copy(gm, mode, (args, kwargs))
    if not unit_modules(model):
        make_units(model)
    with _fake_mesh(world_size) as mesh, fake_kernels_active(), mode:
        fully_shard_units(model, mesh=mesh)
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = optimizer_over(optimizer, trained) if optimizer is not None else None
        totals = step_peak(model, opt, args, kwargs, microbatches=2 if accumulate else 1, loss=loss)
    units = [list(unit.parameters()) for unit in unit_modules(model)]
    inside = {id(p) for params in units for p in params}
    units.append([p for p in model.parameters() if id(p) not in inside])  # the root's own
    slack = max(_reduce_scatter_bytes(params, world_size) for params in units)
    return RankPeak(int(totals["Total"]), {getattr(k, "value", str(k)): int(v) for k, v in totals.items()
                                           if k != "Total" and v}, slack)


def _reduce_scatter_bytes(params: list, world_size: int) -> int:
    """A unit's reduce-scatter input: each gradient padded along dim 0 to a multiple of the ranks."""
    total = 0
    for p in params:
        if p.requires_grad:
            rows = -(-p.shape[0] // world_size) * world_size if p.dim() else world_size
            total += rows * (p.numel() // max(p.shape[0], 1) if p.dim() else 1) * p.element_size()
    return total


def step_peak(model: torch.nn.Module, opt: torch.optim.Optimizer | None, args: tuple, kwargs: dict, *,
              microbatches: int = 1, loss: Callable | None = None, run: Callable | None = None) -> dict:
    """FSDPMemTracker's totals at the peak of model's second training step (the optimizer's state
    made by the first), by category and "Total": a prediction on fakes, a measurement on real
    tensors (tests and benchmarks measure ranks so). The step's forward and backward: run(), or
    `microbatches` backwards of loss(model, args, kwargs) on the batch (their memory is a
    microbatch's: the gradients add up)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    loss = loss or _graph_loss

    def backwards():
        for _ in range(microbatches):
            loss(model, args, kwargs).backward()

    _step(model, opt, run or backwards)
    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs(args)
    # the tracker refuses a second forward of the root (a microbatch after the first) unless its
    # per-module stats are cleared first; its peak, all this reads, stays. Registered before the
    # tracker's own global hooks, so it runs first.
    fresh = register_module_forward_pre_hook(lambda module, _: tracker.reset_mod_stats() if module is model else None)
    try:
        with tracker:
            _step(model, opt, run or backwards)
    finally:
        fresh.remove()
    return next(iter(tracker.get_tracker_snapshot("peak").values()))


def _graph_loss(model, args: tuple, kwargs: dict) -> torch.Tensor:
    return sum(loss.sum() for loss in backward_roots(model(*args, **kwargs)))


def _step(model, opt, backwards: Callable) -> None:
    backwards()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        for p in model.parameters():
            p.grad = None


@contextlib.contextmanager
def _fake_mesh(world_size: int):
    """A device mesh of world_size ranks over a fake process group: this process's own where it
    has none, else a group of its world (every rank makes it, as a new group needs).

    The mesh's dimension has a name of its own: DTensor caches sharding results by mesh, and two
    meshes of one shape are equal, so a fake mesh of the user's shape would be handed to the user's
    sharded parameters after its group is gone (a later full_tensor() fails to find it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise UsageError(f"world_size={world_size}, but this process's group has {dist.get_world_size()} "
                             "ranks: give the world the step runs in, or plan outside it.")
        group = dist.new_group(backend="fake")
        try:
            yield DeviceMesh.from_group(group, "cpu", mesh_dim_names=(ESTIMATE_DIM,))
        finally:
            dist.destroy_process_group(group)
        return
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world_size,), mesh_dim_names=(ESTIMATE_DIM,))
    finally:
        dist.destroy_process_group()
