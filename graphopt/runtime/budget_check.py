"""The check that keeps a memory budget's promise at sizes the plan was not made for.

A recompute plan is made for the example's sizes; the graph runs at others (a dynamic batch or
sequence length, any size under torch.fx), where its step may need more memory. So a call at
other sizes first runs the step's estimate there (analysis/memory.estimate_peak: one FakeTensor
step, nothing allocated), once per input signature, and raises BudgetError where it does not
fit the plan's target: a plan made for the longest length serves every shorter one, and never
a longer one silently. The estimate is the one the plan was confirmed by, at the new sizes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..analysis.memory import as_given, estimate_peak, size_text
from ..errors import BudgetError
from ..frontend.call_signature import signature
from ..frontend.graph_inputs import placeholder_values
from .guards import describe_call


@dataclass
class BudgetCheck:
    """Called as a forward pre-hook (with kwargs) of the optimized module."""

    budget: int  # bytes, as budget_gb gave them
    target: int  # bytes the step's estimate must stay within: the budget less its headroom
    train: bool
    optimizer: object  # analysis.optimizer_memory.OptimizerMemory or None
    accumulate: bool
    example: tuple  # (args, kwargs) the plan was made for
    host_gradients: bool = False  # the plan takes each gradient off the device as backward makes it
    peaks: dict = field(default_factory=dict)  # by signature: the estimated peak bytes there

    def __post_init__(self):
        self.peaks.setdefault(signature(*self.example), None)  # the plan's own: confirmed by the pass

    def peak(self, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> int | None:
        """The step's estimated peak bytes for this call (None: the example's signature, which
        the plan was made for)."""
        key = signature(args, kwargs)
        if key not in self.peaks:
            self.peaks[key] = estimate_peak(gm, placeholder_values(gm, args, kwargs), train=self.train,
                                            optimizer=self.optimizer, accumulate=self.accumulate,
                                            host_gradients=self.host_gradients).peak_bytes
        return self.peaks[key]

    def why_not(self, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> str | None:
        """Why this call's step would not fit the budget; None when it fits."""
        peak = self.peak(gm, args, kwargs)
        if peak is None or peak <= self.target:
            return None
        return (f"at {describe_call(args, kwargs)} its step needs {size_text(peak)} by the estimate, over the "
                f"{size_text(self.target)} its plan for {describe_call(*self.example)} keeps within "
                f"{as_given(self.budget)}")

    def __call__(self, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
        why = self.why_not(gm, args, kwargs)
        if why is not None:
            raise BudgetError(
                f"this graphopt module's recompute plan was made for other sizes: {why}. Optimize it with the "
                "largest batch and longest sequence as the example (its plan then serves every smaller one), or "
                "use graphopt.optimize(model, budget_gb=...) without example inputs, which plans again where a "
                "plan does not fit.")
