"""What an optimizer adds to a training step's memory: its state, resident from the first
step on, and the temporaries of its step(), which runs while every gradient is alive.

Both are measured, not assumed: the optimizer's own class runs step() twice on FakeTensor
copies of its parameters under the instrument that measures a real step (live_storage.py).
The first step makes the state; the second, with the state resident, shows the temporaries
(foreach Adam's square roots and sums, weight decay's copies, ...). Only the parameters and
gradients are fakes: the optimizer's step counters stay real scalars, as they are on CPU.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import OptionError
from .live_storage import LiveStorage
from .planning_device import planning_device

# optimizer= by name: the class and the settings it is built with
NAMED = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
}


@dataclass(frozen=True)
class OptimizerMemory:
    state_bytes: int  # resident through the whole step
    step_bytes: int   # temporaries of step(), above parameters, gradients and state


def check_optimizer(value):
    """An optimizer= value: a torch.optim.Optimizer, one of NAMED, or None."""
    if value is None or isinstance(value, torch.optim.Optimizer):
        return value
    if isinstance(value, str) and value.lower() in NAMED:
        return value.lower()
    raise ValueError(f"must be a torch.optim.Optimizer or one of {', '.join(NAMED)}, got {value!r}")


def optimizer_memory(optimizer, params: list[torch.Tensor]) -> OptimizerMemory:
    """State and step temporaries of `optimizer` (an instance: its class, settings and parameter
    groups; a name in NAMED: that optimizer over `params`, the trainable ones). A name's answer is
    kept for parameters of the same shapes, dtypes and devices: train_step and plan plan one model
    several times, and the two fake steps of a large model's optimizer take seconds."""
    if not isinstance(optimizer, str):
        return _measured(optimizer, params)
    key = (optimizer, planning_device(),
           tuple((tuple(p.shape), p.dtype, str(p.device), p.requires_grad) for p in params))
    if key not in _NAMED:
        _NAMED[key] = _measured(optimizer, params)
        while len(_NAMED) > 8:
            _NAMED.popitem(last=False)
    return _NAMED[key]


_NAMED: OrderedDict = OrderedDict()  # (name, the parameters' metadata) -> OptimizerMemory


def _measured(optimizer, params: list[torch.Tensor]) -> OptimizerMemory:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = {}
    fake_optimizer = rebuilt(optimizer, params, lambda p: fakes.setdefault(id(p), _fake_parameter(mode, p)))
    resident = [t for p in fakes.values() for t in (p, p.grad)]
    with LiveStorage(resident):  # the first step makes the state
        fake_optimizer.step()
    state = [t for s in fake_optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    with LiveStorage(resident + state) as second:
        fake_optimizer.step()
    return OptimizerMemory(second.live - sum(t.untyped_storage().nbytes() for t in resident),
                           second.peak - second.live)


def optimizer_over(optimizer, params: list) -> torch.optim.Optimizer:
    """`optimizer` built again over `params` (one group): a name in NAMED, or an instance's class with
    its first group's settings (what its state's size depends on)."""
    if isinstance(optimizer, str):
        cls, settings = NAMED[optimizer]
    else:
        cls, settings = type(optimizer), {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return _build(optimizer, cls, params, **settings)


def rebuilt(optimizer, params: list[torch.Tensor], swap=lambda p: p) -> torch.optim.Optimizer:
    """A new optimizer built as `optimizer` is (an instance: its class, settings and parameter
    groups; a name in NAMED: that optimizer over the trainable `params`), over swap(p) for each
    parameter p: stand-ins to measure it, or the same parameters to step them without touching
    the user's optimizer's state."""
    if isinstance(optimizer, str):
        cls, settings = NAMED[optimizer]
        groups = [{**settings, "params": [p for p in params if p.requires_grad]}]
    else:
        cls = type(optimizer)
        groups = [dict(g) for g in optimizer.param_groups]
    for g in groups:
        g["params"] = [swap(p) for p in g["params"]]
    return _build(optimizer, cls, groups)


def _build(optimizer, cls, *args, **settings) -> torch.optim.Optimizer:
    """cls(*args, **settings), or OptionError: a user's optimizer class may not build again."""
    try:
        return cls(*args, **settings)
    except Exception as e:  # noqa: BLE001 (the user's optimizer class, whatever it raises)
        raise OptionError(f"optimizer={type(optimizer).__name__}: cannot build it again over stand-in "
                          f"parameters to measure its memory ({type(e).__name__}: {e}); give its name "
                          f"instead ({', '.join(NAMED)}).") from e


def _fake_parameter(mode: FakeTensorMode, p: torch.Tensor) -> torch.Tensor:
    fake = torch.nn.Parameter(mode.from_tensor(p.detach()), requires_grad=True)
    with mode:
        fake.grad = torch.zeros_like(fake)
    return fake


@functools.lru_cache(maxsize=None)
def state_per_byte(name: str) -> float:
    """State bytes per parameter byte of the optimizer NAMED `name`: its state measured on one
    stand-in parameter of 2**16 elements (large enough that per-parameter scalars, such as
    Adam's step counter, do not count), for a planner that sums parameters per stage."""
    stand_in = torch.nn.Parameter(torch.zeros(2**16))
    return optimizer_memory(name, [stand_in]).state_bytes / stand_in.untyped_storage().nbytes()
