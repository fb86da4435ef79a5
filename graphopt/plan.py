"""graphopt.plan: will one training step fit a device, and with which plan, without the device.

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (4, 2048), device="meta")
    print(graphopt.plan(model, (ids,), {"labels": ids}, budget_gb=80, device="cuda", optimizer="adamw"))

The model and the example may live on the meta device: nothing is allocated. The plan is
the one graphopt.train_step makes (optimize's passes, the recompute plan, the fewest equal
microbatches whose step fits), every analysis run on FakeTensors as if on `device`
(analysis/planning_device.py): CUDA's allocator rounds each block to 512 bytes, and
recompute plans for the budget less its CUDA headroom. On CPU the predicted peak is the
step's live storages, as on a real model. On CUDA the kernels' saved tensors are the CPU's
stand-ins (a CPU build of torch cannot make a CUDA fake): the fused attention keeps its
output and log-sum-exp on both; cuBLAS's workspaces are counted (analysis/cuda_workspaces.py), and
cuDNN's and the allocator's slack are what the headroom is for.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from .analysis.host_step import HostStep
from .analysis.memory import headroom, headroom_text, size_text
from .analysis.planning_device import planning_for
from .analysis.trial import tensor_leaves
from .errors import BudgetError, BudgetWarning, OptionError
from .frontend.export_batch import ExportCache, keeping_exports
from .training.train_step import TrainStep

DEVICES = ("cpu", "cuda")
_REAL_STEPS = ("calibrate", "profile", "verify")  # optimize options that run the model for real
_PROBE_GB = 1e-9  # a budget nothing fits: its BudgetError names the least


@dataclass(frozen=True)
class StepPlan:
    """What graphopt.plan found. Bytes are of one training step on `device`."""

    device: str
    budget_bytes: int | None
    least_bytes: int                   # the least budget the whole batch's step needs (recompute's least)
    microbatches: int | None = None    # the fewest equal microbatches that fit the budget; None: none fits
    predicted_peak_bytes: int | None = None  # the chosen plan's step
    segments: int = 0                  # recompute segments of the plan, on one microbatch
    recomputed_nodes: int = 0
    recompute_overhead_pct: float = 0.0  # estimated recompute time, per cent of a step's
    notes: list[str] = field(default_factory=list)
    world_size: int | None = None      # with shard='fsdp': the bytes are one rank's under FSDP2 over so many
    headroom: float = 0.0              # the fraction of a budget kept free above the step's peak (CUDA's)
    refusal: str = ""                  # where the budget does not fit: why, with the least plan's parts
    host_step: HostStep | None = None  # where the plan steps the optimizer on the host: what it moves and costs
    host_step_overhead_pct: float = 0.0  # its seconds, per cent of the step's estimated time on the device
    offloaded_bytes: int = 0           # the recompute segments' inputs the plan keeps on the host, a step
    step_seconds: float | None = None  # the chosen plan's step by the time model: its microbatches, their
                                       # recompute, the host step and the copies of what is offloaded
    rank_host_bytes: int = 0           # with world_size: a rank's shards on the host (CPUOffloadPolicy), their bytes

    @property
    def fits(self) -> bool:
        return self.microbatches is not None

    def __str__(self) -> str:
        step = f"one rank's step under FSDP2 over {self.world_size} ranks" if self.world_size else "one step"
        kept = headroom_text(self.least_bytes, self.headroom)
        lines = [f"device {self.device}: {step} needs a budget of at least {size_text(self.least_bytes)} "
                 f"(the whole batch, recompute's least plan{': ' + kept if kept else ''})"]
        if self.budget_bytes is not None:
            budget = f"budget {size_text(self.budget_bytes)}"
            if self.fits:
                batch = "the whole batch" if self.microbatches == 1 else f"{self.microbatches} microbatches"
                free = f", within the budget less the {self.headroom:.0%} kept free" if self.headroom else ""
                rerun = (f"{self.segments} recompute segments, {self.recomputed_nodes} nodes rerun (about "
                         f"{self.recompute_overhead_pct:g}% of a step)") if self.segments else "nothing recomputed"
                lines.append(f"{budget}: fits as {batch}, predicted peak {size_text(self.predicted_peak_bytes)}{free}; "
                             f"{rerun}")
                if self.step_seconds is not None:
                    lines.append(f"predicted step time {self.step_seconds:.3g} s (the time model's estimate)")
                if self.host_step is not None:
                    h, seconds = self.host_step, self.host_step.seconds_over(self.microbatches)
                    lines.append(f"the optimizer's {h.moved} on the host: {size_text(h.device_bytes_freed)} off "
                                 f"the device, {size_text(h.host_bytes)} of host memory, about {seconds:.2f} s more "
                                 f"a step ({self.host_step_overhead_pct:g}% of the step on the device, by the "
                                 "estimate)")
                if self.offloaded_bytes:
                    also = " too" if self.host_step is not None else ""
                    lines.append(f"the recompute segments' inputs on the host{also}: {size_text(self.offloaded_bytes)} "
                                 "copied out in the forward and back in the backward of each step")
                if self.rank_host_bytes:
                    lines.append(f"a rank's sharded parameters, gradients and optimizer state on the host (FSDP2's "
                                 f"CPUOffloadPolicy): {size_text(self.rank_host_bytes)} of host memory")
            else:
                lines.append(f"{budget}: does not fit in any number of equal microbatches: {self.refusal}")
        return "\n".join(lines + self.notes)


def plan(model: torch.nn.Module, example_inputs, example_kwargs: dict | None = None, *, budget_gb: float | None = None,
         device: str = "cuda", optimizer=None, loss_fn=None, **optimize_options) -> StepPlan:
    """The least budget one training step of `model` on `example_inputs` needs on `device`, and
    with budget_gb, the plan graphopt.train_step would make for it (recompute segments and the
    fewest microbatches that fit). optimizer: a torch.optim.Optimizer or a name (adamw, adam,
    sgd, momentum), whose state and step count. Other options go to graphopt.optimize
    (precision, passes, shard and world_size: a rank's step under FSDP2, ...)."""
    if device not in DEVICES:
        raise OptionError(f"device={device!r}: graphopt plans for one of {', '.join(DEVICES)}.")
    real = [name for name in _REAL_STEPS if optimize_options.get(name)]
    if real:
        raise OptionError(f"graphopt.plan runs nothing for real: {', '.join(real)}=True needs real steps; plan "
                          "without it, or call graphopt.optimize on the device.")
    tensors = (*model.parameters(), *model.buffers(), *tensor_leaves((example_inputs, example_kwargs)))
    found = {t.device.type for t in tensors}
    if found - {"meta", device}:
        raise OptionError(f"graphopt.plan plans for device={device!r} a model whose tensors are on the meta device "
                          f"or on {device!r}; this one has tensors on {', '.join(sorted(found - {'meta'}))}. Build it "
                          "under `with torch.device('meta'):` (nothing is allocated), or plan for its device.")
    options = dict(optimize_options, optimizer=optimizer)
    # the least's step and the budget's share one export (train_step keeps the one open); a budget
    # above the step's peak is an answer here ("nothing recomputed"), not a mistake to warn of
    with planning_for(device), keeping_exports(ExportCache()), warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetWarning)
        least = _least(model, example_inputs, example_kwargs, loss_fn, options)
        kept = headroom(device)
        ranks = options.get("world_size")  # given without shard, optimize refuses it
        if budget_gb is None:
            return StepPlan(device, None, least, world_size=ranks, headroom=kept)
        try:
            step = TrainStep(model, example_inputs, example_kwargs, loss_fn=loss_fn, budget_gb=budget_gb, **options)
        except BudgetError as e:
            return StepPlan(device, e.budget_bytes, least, world_size=ranks, headroom=kept, refusal=str(e))
    record = step.report.recompute()
    stats = record.stats if record is not None else {}
    shard = step.report.record("shard")
    return StepPlan(device, step.budget_bytes, least, step.microbatches, step.predicted_peak_bytes,
                    stats.get("segments", 0), stats.get("recomputed_nodes", 0),
                    stats.get("recompute_overhead_pct", 0.0), notes=list(step.notes), world_size=step.world_size,
                    headroom=kept, host_step=step.report.host_step,
                    host_step_overhead_pct=_host_step_pct(step.microbatches, stats, step.report.host_step),
                    offloaded_bytes=stats.get("offloaded_bytes", 0),
                    step_seconds=_step_seconds(step.microbatches, stats, step.report.host_step),
                    rank_host_bytes=shard.stats.get("rank_host_bytes", 0) if shard is not None else 0)


def _step_seconds(microbatches: int, stats: dict, host: HostStep | None) -> float | None:
    """One step's seconds by the time model: each microbatch's step with its recompute and the copies
    of its offloaded inputs (or a rank's shards), then the host step with what each microbatch's gradients
    add to it (or a rank's step over its shard); None where the recompute pass did not estimate the step."""
    if "step_ms" not in stats:
        return None
    device = microbatches * (stats["step_ms"] * (1 + stats.get("recompute_overhead_pct", 0.0) / 100)
                             + stats.get("offload_ms", 0.0) + stats.get("rank_host_copy_ms", 0.0)) / 1e3
    return device + (host.seconds_over(microbatches) if host is not None else stats.get("rank_host_step_ms", 0.0) / 1e3)


def _host_step_pct(microbatches: int, stats: dict, host: HostStep | None) -> float:
    """The host step's seconds over `microbatches`, per cent of their steps on the device (the pass
    priced one microbatch's)."""
    if host is None or not host.seconds:
        return 0.0
    over = host.seconds_over(microbatches) / (host.seconds * microbatches)
    return round(stats.get("host_step_overhead_pct", 0.0) * over, 1)


def _least(model, example_inputs, example_kwargs, loss_fn, options) -> int:
    """The least budget of the whole batch's step."""
    try:
        TrainStep(model, example_inputs, example_kwargs, loss_fn=loss_fn, budget_gb=_PROBE_GB, microbatches=1,
                  **options)
    except BudgetError as e:
        return e.min_budget_bytes
    return 0  # a step that holds no tensor fits any budget
