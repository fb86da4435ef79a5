"""One training step as its user runs it (forward, the loss, backward), measured: peak bytes,
live bytes over the step, wall time. What the demo, the command line and train_step report,
what the corpus tests hold graphopt's predictions to, and what `graphopt.measure_step` (measure.py) measures."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..analysis.memory import GB, measure_peak, size_text
from ..analysis.live_storage import LiveStorage, from_first_op
from ..errors import UsageError


def output_loss(output) -> torch.Tensor:
    """The loss a model returns: its output's `.loss` (or ["loss"]), or the output itself when
    it is a scalar tensor. UsageError otherwise: then the caller must say how to get one."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise UsageError(f"the model returned {type(output).__name__}, with no scalar loss (no `.loss`, not a "
                         "scalar tensor): give loss_fn=... (on the command line, --loss pkg.module:function), a "
                         "function of (output, *args, **kwargs) that returns the scalar loss.")
    return loss


def step_loss(module, args: tuple, kwargs: dict, loss_fn: Callable | None = None) -> torch.Tensor:
    """Forward and the loss, as the user writes them: loss_fn(output, *args, **kwargs), or the
    model's own loss."""
    output = module(*args, **kwargs)
    return output_loss(output) if loss_fn is None else loss_fn(output, *args, **kwargs)


def run_step(module, args: tuple, kwargs: dict | None = None, loss_fn: Callable | None = None) -> torch.Tensor:
    """Forward, loss, backward; the detached loss."""
    loss = step_loss(module, args, kwargs or {}, loss_fn)
    loss.backward()
    return loss.detach()


def clear_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def step_peak(module, model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
              loss_fn: Callable | None = None) -> int:
    """Measured peak bytes of one step of `module` (the model or its optimized graph) over the
    resident parameters and buffers of `model`; gradients None before and after."""
    kwargs = kwargs or {}
    clear_grads(model)
    try:
        return measure_peak(lambda: run_step(module, args, kwargs, loss_fn), model, *args, *kwargs.values())
    finally:
        clear_grads(model)


def step_timeline(module, model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
                  loss_fn: Callable | None = None) -> list[int]:
    """Live bytes after every allocation and free of one step on CPU, from the resident state
    (parameters and buffers of `model` and the inputs, the first point) on: the curve whose
    maximum step_peak is."""
    kwargs = kwargs or {}
    resident = [*model.parameters(), *model.buffers(), *args, *kwargs.values()]
    clear_grads(model)
    try:
        with LiveStorage([t for t in resident if isinstance(t, torch.Tensor)], timeline=True) as live:
            run_step(module, args, kwargs, loss_fn)
        return [live_bytes for _, live_bytes in from_first_op(live.timeline)]
    finally:
        clear_grads(model)


def step_seconds(steps: dict[str, Callable], repeats: int = 7) -> dict[str, float]:
    """Median wall time of each step, run in turns after one warm-up round: on a shared machine
    drift then falls on every step alike, and their ratios hold where absolute times do not. With
    CUDA in use each step ends when its kernels do, not when they are launched."""
    times = {name: [] for name in steps}
    for k in range(repeats + 1):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            if k:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


@dataclass(frozen=True)
class StepMeasure:
    """One training step, measured by `graphopt.measure_step`."""

    peak_bytes: int  # the step's peak: parameters, buffers and inputs included; gradients None at its start
    step_ms: float  # median wall time of a step (forward, loss, backward)

    @property
    def peak_gb(self) -> float:
        """The peak in the unit of `budget_gb`: GB of 10**9 bytes."""
        return self.peak_bytes / GB

    def __str__(self) -> str:
        return f"peak {size_text(self.peak_bytes)} ({self.peak_gb:.4g} GB), step {self.step_ms:.1f} ms"
