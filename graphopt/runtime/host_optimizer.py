"""The optimizer's step on the host (analysis/host_step.py says what it frees and what it costs),
installed on the user's own optimizer, so that `loss.backward(); optimizer.step();
optimizer.zero_grad()` stays as it was.

Installed through torch.optim.Optimizer's own hooks:
- a step pre-hook copies each gradient down into its parameter's host copy (and a parameter
  written on the device since, a checkpoint loaded into the model, say, down first), copies the user's
  param-group settings (a scheduler's learning rate) to the host optimizer's groups, runs the
  host optimizer's step, copies each parameter back up, and sets the device gradients aside, so
  that the user's own step, which runs next, finds none and changes nothing;
- a step post-hook gives the gradients back: zero_grad, and code after the step, see them as
  they would without the host step;
- state_dict hooks put the host optimizer's state in the user's state_dict, and take a loaded
  one to the host, so a checkpoint holds the state where it lives.

Where the plan takes the gradients to the host too (HostStep.gradients), each parameter's gradient
is copied down as backward makes it (a post-accumulate-grad hook, added into what the host holds
while the user accumulates) and leaves the device; at the end of backward its .grad on the device
becomes a HostGradient, a stand-in that any op refuses, so that code reading .grad (clipping,
logging) stops with a UsageError instead of finding no gradient. zero_grad() (wrapped on the
instance) clears both sides.

The host optimizer is the user's built again (class, groups and settings) over the host copies,
with its fused CPU kernel where the user chose no implementation (fused and foreach unset: torch's
default on the CPU is its per-parameter loop, 5 to 7 times slower on AdamW): within rounding of
the device step. Where the user chose one (foreach=False, say), the host runs it: on CPU the same
kernels on the same values, bitwise the device step's. Host work runs in host_tier.on_host(): it is
not device memory.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from ..analysis.host_tier import on_host
from ..analysis.optimizer_memory import rebuilt
from ..errors import UsageError
from . import copy_streams

_INSTALLED = "_graphopt_host_optimizer"
KERNELS = ("fused", "foreach")  # a group's implementation: the host's own, not synced from the user's
ON_HOST = ("this parameter's gradient is on the host: graphopt's plan takes each gradient off the device as "
           "backward makes it, to fit the budget, and steps the optimizer there. Read the gradients with "
           "graphopt.runtime.host_optimizer.host_gradients(optimizer), or give a budget_gb that holds them on "
           "the device.")


class HostGradient(torch.Tensor):
    """A parameter's .grad on the device while its gradient is on the host: its shape, dtype and
    device, and no storage; any op on it raises UsageError."""

    @staticmethod
    def __new__(cls, like: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise UsageError(ON_HOST)

    def __repr__(self) -> str:
        return f"HostGradient({tuple(self.shape)}, {self.dtype}: on the host)"


class HostOptimizer:
    """The host side of `optimizer`: host copies of its parameters and the optimizer over them."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.user = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        # derived once: on CUDA (this device) the host's copies are pinned, and each step waits for its copies down
        self.cuda = next((p.device for p in self.params if p.device.type == "cuda"), None)
        self.pinned = self.cuda is not None
        with torch.no_grad(), on_host():
            self.hosts = {p: torch.empty(p.shape, dtype=p.dtype, pin_memory=self.pinned).copy_(p) for p in self.params}
            for h in self.hosts.values():
                h.requires_grad_(True)
            self.host = fastest_on_host(rebuilt(optimizer, self.params, swap=lambda p: self.hosts[p]))
            self.kernels = [{k: g[k] for k in KERNELS if k in g} for g in self.host.param_groups]
            if optimizer.state:  # a resumed optimizer: its state moves to the host
                self._load(_on_host(optimizer.state_dict()))
                optimizer.state.clear()
        self.versions = {p: p._version for p in self.params}  # what the host copies hold
        self._set_aside: list | None = None
        self.gradients = False  # each gradient copied down as backward makes it (move_gradients)
        self._standing_in = False  # the end of this backward puts the stand-ins in
        self.handles = [optimizer.register_step_pre_hook(self._before_step),
                        optimizer.register_step_post_hook(self._after_step),
                        optimizer.register_state_dict_post_hook(self._state_dict),
                        optimizer.register_load_state_dict_pre_hook(self._load_state_dict)]

    def move_gradients(self) -> None:
        """From now on each gradient leaves the device for the host as backward makes it."""
        if self.gradients:
            return
        self.gradients = True
        for p in self.params:
            if p.requires_grad:
                self.handles += [p.register_hook(functools.partial(self._clear_stand_in, p)),
                                 p.register_post_accumulate_grad_hook(self._gradient_down)]
        self._zero_grad = self.user.zero_grad
        self.user.zero_grad = self._zero_both  # on the instance: the user's calls reach it

    def _clear_stand_in(self, p, grad):
        """Before a gradient accumulates into p.grad: a stand-in left there goes (the host holds it)."""
        if isinstance(p.grad, HostGradient):
            p.grad = None
        return grad

    def _gradient_down(self, p) -> None:
        h = self.hosts[p]
        with torch.no_grad(), on_host():
            if h.grad is None:
                h.grad = torch.empty(h.shape, dtype=h.dtype, pin_memory=self.pinned)
                if self.cuda is not None:  # on the down stream, beside the rest of backward; read after settle()
                    copy_streams.down(p.grad, into=h.grad, marked=False)
                else:
                    h.grad.copy_(p.grad)
            else:  # accumulating: added to what the host holds, once its copy has landed
                if self.cuda is not None:
                    copy_streams.settle(self.cuda)
                h.grad.add_(p.grad.to(h.device, copy=True))
        p.grad = None
        if not self._standing_in:
            self._standing_in = True
            torch.autograd.Variable._execution_engine.queue_callback(self._stand_in)

    def _stand_in(self) -> None:
        self._standing_in = False
        for p, h in self.hosts.items():
            if h.grad is not None and p.grad is None:
                p.grad = HostGradient(p)

    def _zero_both(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if isinstance(p.grad, HostGradient):
                p.grad = None
        self._zero_grad(set_to_none)
        with torch.no_grad(), on_host():
            for h in self.hosts.values():
                if set_to_none:
                    h.grad = None
                elif h.grad is not None:
                    h.grad.zero_()

    def _before_step(self, optimizer, args, kwargs):
        if args[1:] or kwargs.get("closure") is not None:  # args[0] is the optimizer itself
            raise UsageError("graphopt's plan steps this optimizer on the host, which a closure cannot run in "
                             "(it would compute gradients after the host took them): call step() without one.")
        for mine, theirs in zip(self.host.param_groups, optimizer.param_groups):
            mine.update({k: v for k, v in theirs.items() if k != "params" and k not in KERNELS})  # a scheduler's lr
        with torch.no_grad(), on_host():
            for p, h in self.hosts.items():
                if p._version != self.versions[p]:  # written since the host's copy (a checkpoint loaded)
                    h.copy_(p, non_blocking=True)
                if isinstance(p.grad, HostGradient) or (self.gradients and p.grad is None):
                    continue  # the host holds it already (or holds none: a parameter backward did not reach)
                if p.grad is None:
                    h.grad = None
                    continue
                if h.grad is None:
                    h.grad = torch.empty(h.shape, dtype=h.dtype, pin_memory=self.pinned)
                h.grad.copy_(p.grad, non_blocking=True)
            if self.cuda is not None:  # every gradient is down before the host reads it
                copy_streams.settle(self.cuda)
                torch.cuda.current_stream(self.cuda).synchronize()
            self.host.step()
        with torch.no_grad():
            for p, h in self.hosts.items():
                if h.grad is not None:
                    p.copy_(h, non_blocking=True)
                self.versions[p] = p._version
        self._set_aside = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def _after_step(self, optimizer, args, kwargs):
        if self._set_aside is not None:
            for p, g in zip(self.params, self._set_aside):
                p.grad = g
            self._set_aside = None

    @contextlib.contextmanager
    def gradients_kept(self):
        """While open, backward's gradients reach the host as in training; after, the host holds
        what it held before: a measured step leaves no trace there."""
        with torch.no_grad(), on_host():
            saved = {p: None if h.grad is None else h.grad.clone() for p, h in self.hosts.items()}
        try:
            yield
        finally:
            for p, h in self.hosts.items():
                h.grad = saved[p]

    def _state_dict(self, optimizer, state_dict):
        with on_host():
            state_dict["state"] = self.host.state_dict()["state"]
        return state_dict

    def _load_state_dict(self, optimizer, state_dict):
        with torch.no_grad(), on_host():
            self._load(_on_host(state_dict))
        return {**state_dict, "state": {}}

    def _load(self, state_dict: dict) -> None:
        """state_dict into the host optimizer, its kernel kept: a loaded group brings the user's settings."""
        self.host.load_state_dict(state_dict)
        for group, kernel in zip(self.host.param_groups, self.kernels):
            group.update(kernel)


def fastest_on_host(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """optimizer built again with fused=True (AdamW's, Adam's, SGD's and Adagrad's fused CPU kernels)
    where no group chose an implementation; as it is where one did, or where the class has no
    fused kernel for these parameters (its constructor refuses)."""
    if not all(g.get("fused", False) is None and g.get("foreach", False) is None for g in optimizer.param_groups):
        return optimizer
    try:
        return type(optimizer)([{**g, "fused": True} for g in optimizer.param_groups])
    except Exception:  # noqa: BLE001 (a class without a fused kernel, or one these parameters do not take)
        return optimizer


def _on_host(state_dict: dict) -> dict:
    """state_dict with its state's tensors copied to host memory: loading would otherwise keep the
    given tensors themselves where they already are on the CPU, shared with their owner."""
    copied = {k: {name: v.to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for name, v in s.items()}
              for k, s in state_dict["state"].items()}
    return {**state_dict, "state": copied}


def host_gradients(optimizer: torch.optim.Optimizer) -> dict:
    """The gradients graphopt's plan keeps on the host, by parameter, for code that reads them
    between backward and step: {parameter: its gradient in host memory, or None}."""
    found = getattr(optimizer, _INSTALLED, None)
    if found is None:
        raise UsageError("this optimizer does not step on the host: its parameters' .grad hold the gradients.")
    return {p: h.grad for p, h in found.hosts.items()}


def installed(optimizer) -> HostOptimizer | None:
    """The host step installed on `optimizer`, if a plan installed one."""
    return getattr(optimizer, _INSTALLED, None)


def install_host_optimizer(optimizer, gradients: bool = False) -> HostOptimizer:
    """The host step on `optimizer` (a torch.optim.Optimizer), installed once however many graphs
    planned it (one per batch size, one per microbatch count); with gradients, the gradients too,
    from the first plan that moves them on."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"the plan steps the optimizer on the host, which needs the optimizer itself, got "
                         f"optimizer={optimizer!r}: give optimizer=torch.optim.AdamW(model.parameters(), ...), "
                         "the one you step, or a budget_gb that holds its state on the device.")
    found = getattr(optimizer, _INSTALLED, None)
    if found is None:
        found = HostOptimizer(optimizer)
        setattr(optimizer, _INSTALLED, found)
    if gradients:
        found.move_gradients()
    return found
