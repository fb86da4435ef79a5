"""A step's estimate held against the same step run for real, storage by storage (an analysis;
graphopt.check_estimate is its public form).

Both run the graph as estimate_peak runs it (memory.traced_step), in the same instrument: once on
FakeTensors (fake_run), once on the example inputs with the module's own parameters, inside
trial_run (gradients, buffers, the example and the RNG put back). Each lists the storages the
step's ops make, in the order they appear, each with the part of the step that made it (a node's
forward, an autograd node's backward, a segment's rerun), the op, its bytes and the position at
which it goes. The first storage whose part, op or bytes differ is where the estimate starts to
miss: another op ran there for real (a copy a layout asked for), or the same op made another size
(a kernel that keeps a buffer its fake does not). Where every storage agrees, the first whose
lifetime differs is named. What a fake kernel lays out otherwise than the real one is most often
the cause (fake_kernels.py keeps such fixes).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.fx

from .fake_state import fake_run
from .memory import size_text, traced_step
from .trial import trial_run


@dataclass(frozen=True)
class Divergence:
    where: str  # the part of the step: "forward linear_1", "backward mse_loss"
    estimated: str  # what the fake step's storage there was
    measured: str  # and the real step's

    def __str__(self) -> str:
        return f"at {self.where}, the estimate's step {self.estimated}; the real step {self.measured}"


@dataclass(frozen=True)
class EstimateCheck:
    predicted_bytes: int  # the fake step's peak
    measured_bytes: int  # the real step's, in the same instrument (live tensor storages)
    divergence: Divergence | None  # the first storage the two steps differ on; None where none does

    @property
    def error(self) -> float:
        """The estimate's error, a fraction of the measured peak (negative: under it)."""
        return (self.predicted_bytes - self.measured_bytes) / max(self.measured_bytes, 1)

    def __str__(self) -> str:
        head = (f"predicted {size_text(self.predicted_bytes)}, measured {size_text(self.measured_bytes)} "
                f"({self.error:+.1%})")
        return head + (f"; first divergence {self.divergence}" if self.divergence else "; every storage agrees")


def check_estimate(gm: torch.fx.GraphModule, flat_inputs: list, example: tuple, *, train: bool = True,
                   optimizer=None, accumulate: bool = False) -> EstimateCheck:
    """The estimate of gm's step on flat_inputs (its placeholders' values; example: the call's
    (args, kwargs), which trial_run puts back) against the step run for real."""
    settings = dict(train=train, optimizer=optimizer, accumulate=accumulate)
    with fake_run(gm, flat_inputs) as (mode, inputs):
        fake = traced_step(gm, inputs, mode, **settings)
        fake_storages = _made(fake)
    with trial_run(gm, example):
        real = traced_step(gm, flat_inputs, contextlib.nullcontext(), **settings)
        real_storages = _made(real)
    return EstimateCheck(fake.peak, real.peak, _first_divergence(fake, fake_storages, real, real_storages))


def _made(tracker) -> list:
    """The storages the step's ops made (resident ones aside), in order."""
    return [s for s in tracker.storages if s.op is not None]


def _first_divergence(fake, fakes: list, real, reals: list) -> Divergence | None:
    for a, b in zip(fakes, reals):
        if (a.event, str(a.op), a.nbytes) != (b.event, str(b.op), b.nbytes):
            where = a.event if a.event == b.event else f"{a.event} (the real step: {b.event})"
            return Divergence(where, f"made {_bytes(a.nbytes)} with {a.op}", f"made {_bytes(b.nbytes)} with {b.op}")
    if len(fakes) != len(reals):
        extra, steps = (fakes, "estimate's") if len(fakes) > len(reals) else (reals, "real")
        s = extra[min(len(fakes), len(reals))]
        return Divergence(s.event, "ends" if steps == "real" else f"made {_bytes(s.nbytes)} with {s.op} more",
                          f"made {_bytes(s.nbytes)} with {s.op} more" if steps == "real" else "ends")
    for a, b in zip(fakes, reals):
        kept, held = _until(fake, a), _until(real, b)
        if kept != held:
            return Divergence(a.event, f"keeps {a.op}'s {_bytes(a.nbytes)} {kept}", f"keeps it {held}")
    return None


def _bytes(n: int) -> str:
    """Exact: storages that part may differ by a few bytes."""
    return f"{n:,} bytes"


def _until(tracker, stored) -> str:
    """Until when a storage lived: the part of the step running when it was freed."""
    if stored.gone_at is None:
        return "past the step's end"
    running = next((event for event, _ in reversed(tracker.timeline[:stored.gone_at]) if event != "free"), None)
    return f"until {running}" if running else "briefly"
