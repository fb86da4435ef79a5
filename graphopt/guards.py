"""Checks installed on an optimized module so that it is never silently wrong.

Tracing bakes the module's train/eval mode into the graph (dropout, BatchNorm, any
`if self.training:`), and some passes plan for the example shapes. A call that does not
match what the graph was built for raises instead of computing something else.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.utils._pytree as pytree

from .errors import ModeError, UsageError


def signature(args: tuple, kwargs: dict) -> tuple:
    """A hashable description of a call: structure, and per tensor its shape, dtype, device."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device.type, leaf.device.index))
        else:
            try:
                hash(leaf)
                parts.append(("value", type(leaf).__name__, leaf))
            except TypeError:
                parts.append(("value", type(leaf).__name__, repr(leaf)))
    return (str(spec), tuple(parts))


def install_mode_guard(gm: torch.fx.GraphModule, training: bool) -> None:
    """Raise ModeError when gm (or any submodule it shares with the model) is in the other mode."""
    modules = list(gm.modules())
    built_for = "training" if training else "inference"
    other = "model.eval()" if training else "model.train()"

    def check(module, args, kwargs):
        if any(m.training != training for m in modules):
            raise ModeError(
                f"this graphopt module was built for {built_for} (its graph bakes in dropout and "
                f"BatchNorm behaviour), but it or a module it shares is now in the other mode. "
                f"For the other mode build another one, e.g. graphopt.optimize({other}, example_inputs, "
                f"train={not training}), or use graphopt.optimize(model) without example inputs, "
                "which rebuilds on a mode change."
            )

    gm.register_forward_pre_hook(check, with_kwargs=True)


REPLAN = ("call it with inputs of those shapes, or use graphopt.optimize(model) without example inputs, "
          "which plans again for each new input signature.")


def install_shape_guard(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, reason: str, advice: str = REPLAN) -> None:
    """Raise when gm is called with other shapes than it was planned for (a pass said so)."""
    expected = signature(args, kwargs)

    def check(module, call_args, call_kwargs):
        if signature(call_args, call_kwargs) != expected:
            raise UsageError(f"this graphopt module was planned for its example input shapes ({reason}); {advice}")

    gm.register_forward_pre_hook(check, with_kwargs=True)
