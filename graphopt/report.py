"""The optimization report: one row per pass, as data, rendered as text or markdown."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .analysis.memory import size_text


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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

    def notes_text(self) -> list[str]:
        """Which passes ran because none were named, why the others of the default did not, which
        inputs the result takes, and the notes of what runs it."""
        lines = [f"runs at: {self.runs_at}"] if self.runs_at else []
        ran = [r.name for r in self.passes if r.by_default]
        if not ran and not self.skipped:
            return lines + self.notes
        lines += [f"default passes run: {', '.join(ran) or 'none'}"]
        lines += [f"default pass not run: {name}: {why}" for name, why in self.skipped.items()]
        return lines + self.notes

    def to_markdown(self) -> str:
        rows = self.rows()
        lines = [f"# graphopt summary: {self.model}", ""]
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
        widths[-1] = min(widths[-1], 70)
        fmt = lambda row: "  ".join(c[:w].ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
        sep = "  ".join("-" * w for w in widths)
        return "\n".join([fmt(rows[0]), sep] + [fmt(r) for r in rows[1:]] + self.notes_text())

    def __str__(self) -> str:
        return self.to_text()


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
