"""`graphopt.measure_step`: one training step as its user runs it, measured (peak bytes as
budget_gb counts them, wall time), for a model, what `graphopt.optimize` returned, or a
`graphopt.train_step`, with or without the optimizer's step at its end."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from .analysis.memory import measure_peak
from .analysis.optimizer_memory import check_optimizer, rebuilt
from .analysis.trial import trial_run
from .errors import OptionError, UsageError
from .runtime.host_optimizer import installed
from .runtime.step import StepMeasure, clear_grads, run_step, step_seconds
from .training.train_step import TrainStep


def measure_step(model, args, kwargs: dict | None = None, loss_fn: Callable | None = None, *, optimizer=None,
                 repeats: int = 3) -> StepMeasure:
    """Measure one training step of `model` (yours, what `graphopt.optimize` returned, or a
    `graphopt.train_step`): forward on `args` and `kwargs`, the loss, backward, from `.grad`
    None, as `budget_gb` counts it.

    The loss is `loss_fn(output, *args, **kwargs)` when given, else the output's `.loss` (or
    `["loss"]`), or the output itself when it is a scalar; a train_step has its own. The peak is
    what `optimize(..., budget_gb=)` is held to: on CPU the bytes of live tensor storages, on
    CUDA the allocator's peak, parameters, buffers and inputs included. The time is the median of
    `repeats` steps after a warm-up one.

    optimizer (a torch.optim.Optimizer, or "adamw", "adam", "sgd", "momentum", as optimize takes
    it): the step ends with the optimizer's step(), its state resident from the start as from a
    training loop's second step on: what `optimize(..., budget_gb=, optimizer=)` plans for. It
    runs on an optimizer built as yours is (class, settings, parameter groups), so yours gains no
    state. An optimizer a plan steps on the host (runtime/host_optimizer.py) holds nothing on the
    device: its step is not run (nor timed), and the gradients reach the host as in training,
    which then holds what it held before. Measuring trains nothing: the parameters, their
    gradients, buffers (BatchNorm statistics), the RNG and the inputs are left as they were.

        m = graphopt.measure_step(model, (x,), {"labels": y}, optimizer=optimizer)
        m.peak_bytes, m.peak_gb, m.step_ms
    """
    trained = model.model if isinstance(model, TrainStep) else model
    if not isinstance(trained, torch.nn.Module):
        raise UsageError(f"measure_step needs a torch.nn.Module (the model, or what graphopt.optimize returned) or "
                         f"what graphopt.train_step returned, got {type(model).__name__}.")
    if isinstance(model, TrainStep) and loss_fn is not None:
        raise UsageError("measure_step of a train_step takes its loss from the train_step (its loss_fn): leave "
                         "loss_fn out.")
    if isinstance(args, torch.Tensor):
        args = (args,)
    if not isinstance(args, (tuple, list)):
        raise UsageError(f"measure_step's args must be a tensor or a tuple of forward()'s positional arguments, got "
                         f"{type(args).__name__}; give keyword arguments as kwargs={{...}}.")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise UsageError(f"measure_step's kwargs must be a dict of forward()'s keyword arguments, got "
                         f"{type(kwargs).__name__}.")
    if not isinstance(repeats, int) or repeats < 1:
        raise UsageError(f"measure_step's repeats must be a whole number of steps, 1 or more, got {repeats!r}.")
    try:
        optimizer = check_optimizer(optimizer)
    except ValueError as e:
        raise OptionError(f"measure_step's optimizer {e}.") from None
    args, kwargs = tuple(args), dict(kwargs or {})
    params = list(trained.parameters())
    host = installed(optimizer) if optimizer is not None else None
    stepper = rebuilt(optimizer, params) if optimizer is not None and host is None else None

    def step():
        clear_grads(trained)
        if isinstance(model, TrainStep):
            model(*args, **kwargs)
        else:
            run_step(model, args, kwargs, loss_fn)
        if stepper is not None:
            stepper.step()

    saved = [p.detach().clone() for p in params] if stepper is not None else []
    try:
        with trial_run(trained, (args, kwargs)), host.gradients_kept() if host else contextlib.nullcontext():
            # Timed first: the warm-up step also builds the graph of a lazy graphopt.optimize(model),
            # and makes the optimizer's state
            seconds = step_seconds({"step": step}, repeats)["step"]
            clear_grads(trained)
            state = [t for s in stepper.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor)] if stepper is not None else []
            peak = measure_peak(step, trained, *args, *kwargs.values(), *state)
            clear_grads(trained)
    finally:
        with torch.no_grad():
            for p, was in zip(params, saved):
                p.copy_(was)
    return StepMeasure(peak_bytes=peak, step_ms=seconds * 1e3)
