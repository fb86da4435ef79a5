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
4. With the shards on the host (host=True: FSDP2's CPUOffloadPolicy), the units are sharded so,
   and the device's peak is the most the tracker counts at any moment less what lives on the host
   then: the sharded parameters and gradients and the optimizer's state. On the fake CPU mesh
   the policy moves nothing, so the copies it makes on a device are added to the slack: a unit's
   shard on its way to the all-gather and its gradients' on their way back.
torchtitan estimates its steps' memory so. Allocator effects (CUDA's block rounding) are not in it.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.nn.modules.module import register_module_forward_pre_hook

from ...analysis.fake_kernels import active as fake_kernels_active
from ...analysis.fake_state import fake_copy
from ...analysis.memory import backward_roots
from ...analysis.optimizer_memory import optimizer_over
from ...errors import UsageError
from ...runtime.fsdp import fully_shard_units, state_on_host, unit_modules
from .units import make_units

ESTIMATE_DIM = "graphopt_rank_estimate"  # the fake mesh's dimension (_fake_mesh)
# what else lowers a rank's step, where a budget is below its least
RANK_ADVICE = "halve activations with precision='bf16', or shard over more ranks (world_size)"


@dataclass(frozen=True)
class RankPeak:
    peak_bytes: int
    breakdown: dict[str, int]  # FSDPMemTracker's categories at the peak (parameters, gradients, buffers, ...)
    slack_bytes: int = 0  # step 3: one unit's reduce-scatter input a backend may still hold (and step 4's copies)
    host_bytes: int = 0   # step 4: the most the rank holds on the host (its shards and the optimizer's state)

    @property
    def bound_bytes(self) -> int:
        """What a plan holds to the budget: the peak and the slack."""
        return self.peak_bytes + self.slack_bytes


def rank_peak(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, world_size: int, optimizer=None, *,
              accumulate: bool = False, loss: Callable | None = None, host: bool | None = None) -> RankPeak:
    """One rank's peak through a training step of gm under FSDP2 over world_size ranks: gm's
    units (the shard pass's, made on the copy where gm has none yet: the recompute pass asks
    before the shard pass runs); optimizer: None (forward and backward only), a name in NAMED or a
    torch.optim.Optimizer (its class and settings); accumulate: the step's microbatches add into
    the sharded gradients (train_step's); loss(module, args, kwargs): the scalar backpropagated
    (a loss outside the graph), by default the graph's losses (memory.backward_roots); host: the
    shards on the host (step 4), by default where gm's plan keeps them there (fsdp.state_on_host)."""
    host = state_on_host(gm) if host is None else host
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    model, (args, kwargs) = fake_copy(gm, mode, (args, kwargs))
    if not unit_modules(model):
        make_units(model)
    with _fake_mesh(world_size) as mesh, fake_kernels_active(), mode:
        fully_shard_units(model, mesh=mesh, **({"offload_policy": CPUOffloadPolicy(pin_memory=False)} if host else {}))
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = optimizer_over(optimizer, trained) if optimizer is not None else None
        totals = step_peak(model, opt, args, kwargs, microbatches=2 if accumulate else 1, loss=loss, host=host)
    units = [list(unit.parameters()) for unit in unit_modules(model)]
    inside = {id(p) for params in units for p in params}
    units.append([p for p in model.parameters() if id(p) not in inside])  # the root's own
    # the gathered parameters' shards down and their gradients' up: each a unit's reduce-scatter input over the ranks
    copies = 2 if host else 0
    slack = max(_reduce_scatter_bytes(params, world_size) * (1 + copies / world_size) for params in units)
    return RankPeak(int(totals["Total"]), {getattr(k, "value", str(k)): int(v) for k, v in totals.items()
                                           if k not in ("Total", HOST_TOTAL) and v}, int(slack),
                    int(totals.get(HOST_TOTAL, 0)))


def shard_bytes(params, world_size: int) -> int:
    """A rank's shard of the trainable parameters: each padded along dim 0 to a multiple of the ranks."""
    return _reduce_scatter_bytes(list(params), world_size) // world_size


def _reduce_scatter_bytes(params: list, world_size: int) -> int:
    """A unit's reduce-scatter input: each gradient padded along dim 0 to a multiple of the ranks."""
    total = 0
    for p in params:
        if p.requires_grad:
            rows = -(-p.shape[0] // world_size) * world_size if p.dim() else world_size
            total += rows * (p.numel() // max(p.shape[0], 1) if p.dim() else 1) * p.element_size()
    return total


HOST_TOTAL = "Host"  # step_peak(host=True)'s key: the most the rank held on the host


@functools.cache
def _trackers() -> tuple[type, type]:
    """torch's FSDPMemTracker, and one that also keeps the most held at any moment less what lives
    on the host under CPUOffloadPolicy (step 4: the sharded parameters and gradients, the optimizer's
    state), with the categories then, and the most held on the host. Imported at the first use:
    torch's tracker imports Triton, whose interpreter switch a process may set after importing graphopt."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    on_host = (_FSDPRefType.SHARDED_PARAM, _FSDPRefType.SHARDED_GRAD, _FSDPRefType.OPT)

    class DeviceTracker(FSDPMemTracker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.device_peak, self.device_snapshot, self.host_peak = 0, {}, 0

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            for snapshot in self._curr_mem_snap.values():
                hosted = sum(snapshot.get(kind, 0) for kind in on_host)
                self.host_peak = max(self.host_peak, hosted)
                if snapshot["Total"] - hosted > self.device_peak:
                    self.device_peak = snapshot["Total"] - hosted
                    self.device_snapshot = {k: v for k, v in snapshot.items() if k not in on_host}

    return FSDPMemTracker, DeviceTracker


def step_peak(model: torch.nn.Module, opt: torch.optim.Optimizer | None, args: tuple, kwargs: dict, *,
              microbatches: int = 1, loss: Callable | None = None, run: Callable | None = None,
              host: bool = False) -> dict:
    """FSDPMemTracker's totals at the peak of model's second training step (the optimizer's state
    made by the first), by category and "Total": a prediction on fakes, a measurement on real
    tensors (tests and benchmarks measure ranks so). The step's forward and backward: run(), or
    `microbatches` backwards of loss(model, args, kwargs) on the batch (their memory is a
    microbatch's: the gradients add up). host: the totals at the device's peak, what lives on the
    host left out (step 4), and under HOST_TOTAL the most the host held."""
    loss = loss or _graph_loss

    def backwards():
        for _ in range(microbatches):
            loss(model, args, kwargs).backward()

    _step(model, opt, run or backwards)
    tracker = _trackers()[1 if host else 0](model, opt)
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
    if host:
        return {**tracker.device_snapshot, "Total": tracker.device_peak, HOST_TOTAL: tracker.host_peak}
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
