"""The optimization report: one row per pass, as data, rendered as text or markdown."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..analysis.batch_wide import BatchWide
from ..analysis.host_step import HostStep
from ..analysis.memory import size_text
from ..passes.records import BudgetFit, PassRecord, idle_budget  # noqa: F401  (read from here by users)

STATS_WIDTH = 70  # the terminal table's stats column wraps here, between stats, never within one


@dataclass
class Report:
    model: str
    frontend: str
    trace_ms: float
    nodes: int
    passes: list[PassRecord] = field(default_factory=list)
    dump_dir: str | None = None
    # passes optimize() chooses when given none that did not pay on this graph, with why
    skipped: dict[str, str] = field(default_factory=dict)
    runs_at: str | None = None  # the input shapes the result accepts, and why
    # what a caller built around the graph decided, as lines (train_step: its microbatches, BatchNorm)
    notes: list[str] = field(default_factory=list)
    # train_step's microbatches per step when more than one: the graph's figures are then one microbatch's
    microbatches: int = 1
    # what of the traced graph depends on the batch as a whole (analysis/batch_wide.py): in eval, its loss's reduction
    batch_wide: BatchWide | None = None
    # with cuda_graphs=True: the signature captured and the bytes its graphs hold beyond the step
    cuda_graphs: str | None = None
    # where the memory plan runs the optimizer's step on the host: what it moves and costs
    host_step: HostStep | None = None

    def to_dict(self) -> dict[str, Any]:
        # batch_wide's loss counters are small graphs: their facts, not the graphs
        return {**asdict(replace(self, batch_wide=None)),
                "batch_wide": self.batch_wide.to_dict() if self.batch_wide is not None else None}

    def rows(self) -> list[list[str]]:
        head = ["#", "pass", "ms", "nodes", "changed", "max err", "peak", "stats"]
        body = [["00", f"trace ({self.frontend})", f"{self.trace_ms:.1f}", f"{self.nodes}", "", "", "", ""]]
        for k, r in enumerate(self.passes, 1):
            err = "" if r.max_rel_err is None else f"{r.max_abs_err:.2e} abs / {r.max_rel_err:.2e} rel"
            peak = "" if r.peak_bytes is None else size_text(r.peak_bytes)
            body.append([
                f"{k:02d}", r.name, f"{r.time_ms:.1f}", f"{r.nodes_before} -> {r.nodes_after}",
                "yes" if r.changed else "no", err, peak, _stats_text(r.stats),
            ])
        return [head] + body

    def record(self, name: str) -> PassRecord | None:
        """The record of the pass called `name` (its settings aside: "shard{world_size=2}" is
        "shard"), the last where it ran more than once."""
        return next((r for r in reversed(self.passes) if r.name.split("{")[0] == name), None)

    def recompute(self) -> PassRecord | None:
        """The record of the pass that planned memory for the budget (recompute): its BudgetFit,
        and its stats for the rest."""
        return next((r for r in reversed(self.passes) if r.budget is not None), None)

    def headline(self) -> str | None:
        """With a budget, one line: the predicted peak before and after recompute, the budget,
        what recompute adds to the step's time, and the measured peak where calibrate measured one."""
        r = self.recompute()
        if r is None:
            return None
        s, fit = r.stats, r.budget
        each = f" for each of {self.microbatches} microbatches" if self.microbatches > 1 else ""
        line = (f"peak {size_text(fit.peak_before_bytes)} -> {size_text(fit.predicted_peak_bytes)} predicted{each} "
                f"(budget {size_text(fit.budget_bytes)})")
        if "measured_peak_bytes" in s:
            line += f", {size_text(s['measured_peak_bytes'])} measured (calibrate)"
        if s.get("plan_cache") == "from the cache":
            line += ", the plan from the plan cache"
        if not s.get("segments"):
            return line + "; nothing recomputed"
        return (line + f"; recompute adds {s['recompute_ms']:g} ms, {s['recompute_overhead_pct']:g}% of the "
                f"step, by {s['cost_by']}")

    def notes_text(self) -> list[str]:
        """A budget that asks for nothing, which passes ran because none were named, why the
        others of the default did not, which inputs the result takes, and the notes of what runs it."""
        record = self.recompute()
        # a microbatch that fits as it is was train_step's choice, not a budget in the wrong unit
        idle = idle_budget(record.budget) if record is not None and self.microbatches == 1 else None
        lines = [idle] if idle else []
        lines += [f"runs at: {self.runs_at}"] if self.runs_at else []
        lines += [f"cuda graphs: {self.cuda_graphs}"] if self.cuda_graphs else []
        if self.host_step is not None:
            h, seconds = self.host_step, self.host_step.seconds_over(self.microbatches)
            lines.append(f"optimizer on the host: its {h.moved}, {size_text(h.device_bytes_freed)} off the device, "
                         f"in {size_text(h.host_bytes)} of host memory; about {seconds * 1e3:.0f} ms more a step "
                         "(gradients down, the host's step, parameters up)")
        ran = [r.name for r in self.passes if r.by_default]
        if not ran and not self.skipped:
            return lines + self.notes
        lines += [f"default passes run: {', '.join(ran) or 'none'}"]
        lines += [f"default pass not run: {name}: {why}" for name, why in self.skipped.items()]
        return lines + self.notes

    def to_markdown(self) -> str:
        rows = self.rows()
        lines = [f"# graphopt summary: {self.model}", ""]
        headline = self.headline()
        if headline:
            lines += [headline, ""]
        lines.append("| " + " | ".join(rows[0]) + " |")
        lines.append("|" + "---|" * len(rows[0]))
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows[1:]]
        defaults = self.notes_text()
        if defaults:
            lines += [""] + [f"- {line}" for line in defaults]
        return "\n".join(lines) + "\n"

    def to_text(self) -> str:
        rows = self.rows()
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        widths[-1] = min(widths[-1], STATS_WIDTH)
        fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
        lines = [fmt(rows[0]), "  ".join("-" * w for w in widths)]
        for row in rows[1:]:
            first, *more = _wrap(row[-1], widths[-1])
            lines += [fmt(row[:-1] + [first])] + [fmt([""] * (len(row) - 1) + [m]) for m in more]
        headline = self.headline()
        return "\n".join(([headline] if headline else []) + lines + self.notes_text())

    def __str__(self) -> str:
        return self.to_text()


def _wrap(text: str, width: int) -> list[str]:
    """Stats text as lines of up to width characters, broken between stats only: a stat longer
    than width has a line of its own, whole."""
    lines: list[str] = []
    for part in text.split(", "):
        if lines and len(lines[-1]) + 2 + len(part) < width:  # and its trailing comma
            lines[-1] += ", " + part
        else:
            lines.append(part)
    return [line + ("," if k < len(lines) - 1 else "") for k, line in enumerate(lines)]


def _stats_text(stats: dict) -> str:
    """Scalars as they are, dicts of counts inline, longer collections by their size."""
    parts = []
    for key, value in stats.items():
        if isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values()):
            value = "{" + " ".join(f"{k}:{v}" for k, v in value.items()) + "}"
        elif isinstance(value, (list, tuple, dict, set)):
            value = f"{len(value)} items"
        parts.append(f"{key}={value}")
    return ", ".join(parts)
