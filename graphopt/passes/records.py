"""What a run of the passes leaves for the report and the dumps, as data: a record per pass, the
budget a planning pass held the step to, the memory curves it predicted, and the dumps' interface.
reporting/ renders these; the passes never import it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.fx

from ..analysis.memory import Estimate, size_text
from ..vocabulary.sizes import in_gb


@dataclass(frozen=True)
class BudgetFit:
    """What a pass that plans memory for a budget (recompute) leaves for others: the budget, the
    bytes it held the step to (the budget less its headroom: CUDA keeps some free), and the
    step's predicted peak before and after it."""

    budget_bytes: int
    planned_for_bytes: int
    peak_before_bytes: int
    predicted_peak_bytes: int


@dataclass(frozen=True)
class MemoryCurves:
    """The step's predicted memory through a pass that planned it (an Estimate with its timeline
    per curve: as traced, with recompute) and the budget it planned for: the dumps draw them."""

    curves: dict[str, Estimate]
    budget_bytes: int | None = None


@dataclass
class PassRecord:
    name: str
    time_ms: float
    nodes_before: int
    nodes_after: int
    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    peak_bytes: int | None = None  # predicted peak memory, when the pass knows it
    by_default: bool = False  # run because optimize() was given no passes
    budget: BudgetFit | None = None  # where the pass planned memory for a budget


@dataclass
class PassLog:
    """A run of the pass manager: a record per pass that ran, the default passes it skipped with
    why, and notes for the report (what verification could not check)."""

    model: str
    passes: list[PassRecord] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class Dumps(Protocol):
    """Where the pass manager hands each graph, kernel source and memory curve for the dumps
    (reporting/dump.Dumper)."""

    def graph(self, index: int, name: str, gm: torch.fx.GraphModule) -> None: ...

    def files(self, index: int, name: str, files: dict[str, str]) -> None: ...

    def memory(self, index: int, name: str, curves: MemoryCurves) -> None: ...


def idle_budget(fit: BudgetFit) -> str | None:
    """What a budget plan says of a budget the step fits as it is, or None: the warning the
    recompute pass gives and the report's note, in one sentence."""
    peak, budget = fit.peak_before_bytes, fit.budget_bytes
    if peak > fit.planned_for_bytes:
        return None
    return (f"budget_gb={in_gb(budget):g} ({size_text(budget)}) is at or above the step's predicted peak of "
            f"{size_text(peak)}: nothing to recompute; budget_gb is in GB = 10**9 bytes (the peak is "
            f"budget_gb={in_gb(peak):.3g})")
