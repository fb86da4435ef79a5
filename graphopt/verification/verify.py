"""Numeric comparison of a rewritten module against the user's eager model.

Both run on the same inputs from the same RNG seed (so dropout draws the same mask),
forward and, in training, backward with the same random cotangents. Gradients and
buffers are restored afterwards: verifying never changes the user's model. verify=True holds
each pass's graph to eager on the example and on a second batch drawn apart from it
(second_batch.py), one `Reference` each.
"""
from __future__ import annotations

import copy as _copy
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from ..analysis.trial import tensor_leaves, trial_run
from .float64_reference import runs_in_float64

# Relative tolerance (max |a - b| / max |reference|) per dtype the rewritten graph computes in.
TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}


# Another order of the same float32 sums lands within an order of magnitude of eager's own error.
ACCURACY_FACTOR = 10


@dataclass
class Errors:
    max_abs: float
    max_rel: float
    worst: str  # which output or gradient had the largest relative error

    def within(self, dtype: torch.dtype) -> bool:
        return self.max_rel <= TOLERANCE.get(dtype, TOLERANCE[torch.float32])


def outputs_and_grads(module, args, kwargs, *, train: bool, seed: int) -> dict[str, torch.Tensor]:
    """Outputs (and in training, parameter gradients) of one step, by name."""
    named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    with trial_run(module, (args, kwargs)):
        torch.manual_seed(seed)
        with torch.set_grad_enabled(train):
            out = module(*args, **kwargs)
        leaves = tensor_leaves(out)
        result = {f"output[{i}]": t.detach().clone() for i, t in enumerate(leaves)}
        if train:
            diff = [t for t in leaves if t.requires_grad and t.is_floating_point()]
            gen = torch.Generator().manual_seed(seed + 1)
            cotangents = [torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t) for t in diff]
            if diff:
                torch.autograd.backward(diff, cotangents)
            for name, p in named_params:
                if p.grad is not None:
                    result[f"grad[{name}]"] = p.grad.detach().clone()
    return result


def compare(reference: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor],
            truth: dict[str, torch.Tensor] | None = None, tolerance: float = 0.0) -> Errors:
    """The largest errors of candidate against reference, entry by entry, and where.

    An entry's relative error is max|candidate - reference| / max|reference|. float32 eager is
    itself only so accurate: a gradient summed from terms that cancel is off from float64 by
    1e-4 and more (an SE block's reduce convolution), and one that is zero in exact arithmetic
    is pure rounding noise (a BatchNorm bias feeding another BatchNorm, an attention key bias);
    another order of the same sums rounds otherwise. With `truth` (the step in float64), an
    entry over `tolerance` counts as tolerance x (its distance to truth over reference's own) /
    ACCURACY_FACTOR when that is less: within tolerance exactly when it is no further from
    float64 than ACCURACY_FACTOR times what float32 eager is.
    """
    if reference.keys() != candidate.keys():
        missing = sorted(set(reference) ^ set(candidate))
        return Errors(float("inf"), float("inf"), f"mismatched outputs/gradients: {', '.join(missing[:5])}")
    worst, max_abs, max_rel = "", 0.0, 0.0
    for key, ref in reference.items():
        got = candidate[key]
        if ref.shape != got.shape:
            return Errors(float("inf"), float("inf"), f"{key}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
        if ref.numel() == 0:
            continue
        r, g = ref.double(), got.double()
        a = _max_abs(r, g)
        scale = float(r.abs().nan_to_num(0.0).max())
        rel = a / scale if scale > 0 else a
        if truth is not None and key in truth and rel > tolerance:
            own, theirs = _max_abs(r, truth[key].double()), _max_abs(g, truth[key].double())
            ratio = theirs / own if own > 0 else (float("inf") if theirs > 0 else 0.0)
            rel = min(rel, tolerance * ratio / ACCURACY_FACTOR)
        max_abs = max(max_abs, a)
        if rel >= max_rel:
            max_rel, worst = rel, key
    return Errors(max_abs, max_rel, worst)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, NaN where both are NaN counting as equal, inf where only one is."""
    both_nan = torch.isnan(a) & torch.isnan(b)
    err = float(torch.where(both_nan, torch.zeros_like(a), (a - b).abs()).max())
    return float("inf") if err != err else err


def float64_copy(module: torch.nn.Module, args: tuple, kwargs: dict):
    """A float64 copy of the module, and the inputs in float64: (module, args, kwargs). Ops without
    a float64 kernel run as float64_reference computes them."""
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.double() if t.is_floating_point() else t,
                                        (args, kwargs))
    return runs_in_float64(_deepcopy(module).double()), args, kwargs


def _deepcopy(module: torch.nn.Module) -> torch.nn.Module:
    """copy.deepcopy, but a tensor autograd made that the module keeps beside its parameters and
    buffers (a cache: timm LeViT's attention biases in eval) is copied detached, as deepcopy
    refuses to copy it; the copy computes with the same values."""
    memo = {}
    for m in module.modules():
        for name, value in vars(m).items():
            if name.startswith("_"):  # parameters, buffers, submodules, hooks: deepcopy's own
                continue
            for t in pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    memo[id(t)] = t.detach().clone()
    return _copy.deepcopy(module, memo)


def float64_step(module: torch.nn.Module, args: tuple, kwargs: dict, *, train: bool, seed: int) -> dict:
    """outputs_and_grads in float64, on a copy: what float32 rounds away from."""
    return outputs_and_grads(*float64_copy(module, args, kwargs), train=train, seed=seed)


def autocast_step(module: torch.nn.Module, args: tuple, kwargs: dict, *, train: bool, seed: int,
                  device: str, dtype: torch.dtype) -> dict:
    """outputs_and_grads under torch.autocast(device, dtype): what the user's own mixed precision computes,
    the yardstick of a graph computing in half precision."""
    with torch.autocast(device_type=device, dtype=dtype):
        return outputs_and_grads(module, args, kwargs, train=train, seed=seed)


class Reference:
    """What a rewritten graph is held to on one batch: eager's step, and, only where the graph is
    further from it than its dtype's tolerance, float64's step (float32 graphs: no further from
    float64 than eager is passes) or torch.autocast's (half precision: within tolerance of
    autocast, or no further from float32 than autocast is, passes)."""

    def __init__(self, model: torch.nn.Module, args: tuple, kwargs: dict, *, train: bool, label: str):
        self.model, self.args, self.kwargs, self.train, self.label = model, args, kwargs, train, label
        self.eager = outputs_and_grads(model, args, kwargs, train=train, seed=0)
        self._truth = self._autocast = None

    def errors(self, gm: torch.nn.Module, dtype: torch.dtype, device: str) -> Errors:
        got = outputs_and_grads(gm, self.args, self.kwargs, train=self.train, seed=0)
        errors = compare(self.eager, got)
        if errors.within(dtype):
            return errors
        if dtype == torch.float32:
            if self._truth is None:
                self._truth = float64_step(self.model, self.args, self.kwargs, train=self.train, seed=0)
            return compare(self.eager, got, self._truth, TOLERANCE[dtype])
        if self._autocast is None:
            self._autocast = autocast_step(self.model, self.args, self.kwargs, train=self.train, seed=0,
                                           device=device, dtype=dtype)
        return compare(self._autocast, got, self.eager, TOLERANCE[dtype])
