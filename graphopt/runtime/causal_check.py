"""The check that keeps normalize's causal-mask rewrite sound at sizes it was not decided for
(passes/causal_masks.py): a forward pre-hook that, once per input signature, runs the subgraph
that built the masks from the inputs' sizes and raises if one is not causal there."""
from __future__ import annotations

import torch
import torch.fx

from ..errors import UsageError
from ..frontend.call_signature import signature
from ..frontend.graph_inputs import placeholder_values
from .guards import describe_call


def is_causal_mask(mask) -> bool:
    """Whether a boolean mask (..., L, S) is, in every (L, S) slice, SDPA's is_causal pattern:
    query i attends to keys 0..i, tril(ones(L, S))."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() < 2:
        return False
    rows, cols = mask.shape[-2:]
    causal = torch.ones(rows, cols, dtype=torch.bool, device=mask.device).tril()
    return bool((mask == causal).all())


class CausalMaskCheck:
    """Called as a forward pre-hook (with kwargs) of the optimized module: `module` takes its
    placeholders and returns the masks the attentions no longer read."""

    def __init__(self, module: torch.fx.GraphModule, example_args: tuple, example_kwargs: dict):
        self.module = module
        self.checked = {signature(example_args, example_kwargs)}  # by the pass, against the attentions' sizes

    def __call__(self, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
        key = signature(args, kwargs)
        if key in self.checked:
            return
        with torch.no_grad():
            masks = self.module(*placeholder_values(gm, args, kwargs))
        # A size-1 dimension may broadcast over the queries or keys: which, the mask alone cannot say.
        if not all(is_causal_mask(m) and 1 not in m.shape[-2:] for m in masks):
            raise UsageError(
                f"this graphopt module runs its attention with is_causal=True where the model's masks, built "
                f"from the input sizes alone, were causal for the example inputs; for inputs "
                f"{describe_call(args, kwargs)} they are not causal, or not of one row per query and one column per "
                "key. Optimize the model again with example inputs of these sizes.")
        self.checked.add(key)
