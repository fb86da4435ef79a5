"""The model's own step against graphopt's, measured in one run: peak memory, step time, what
was recomputed. What `make demo` and `python -m graphopt optimize --measure` print and write
(summary.json, summary.md, memory.png)."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..analysis.memory import size_text
from ..errors import GraphoptError
from ..runtime.step import clear_grads, run_step, step_peak, step_seconds, step_timeline


@dataclass
class Line:
    """One configuration of the step, measured."""

    label: str
    options: dict
    peak_bytes: int | None = None
    step_ms: float | None = None
    predicted_bytes: int | None = None
    recomputed: str = ""
    refused: str = ""  # the graphopt error that refused the configuration
    optimize_s: float | None = None


@dataclass
class BeforeAfter:
    model: str
    budget_bytes: int | None
    lines: list[Line] = field(default_factory=list)
    timelines: dict[str, list[int]] = field(default_factory=dict)  # label -> live bytes over the step
    reports: dict[str, str] = field(default_factory=dict)  # label -> the pass report as markdown
    dumped: str | None = None  # the label whose pass-by-pass dumps measure() wrote
    seconds: float | None = None  # the whole run's wall time, where its caller keeps it

    @property
    def eager(self) -> Line:
        return self.lines[0]

    @property
    def optimized(self) -> Line | None:
        """The first graphopt configuration that ran."""
        return next((line for line in self.lines[1:] if not line.refused), None)

    def over_budget(self) -> list[Line]:
        return [line for line in self.lines[1:] if self.budget_bytes and line.peak_bytes
                and "budget_gb" in line.options and line.peak_bytes > self.budget_bytes]

    def rows(self, refusals_below: bool = False) -> list[list[str]]:
        """The table; refusals_below: a refused configuration's row says so in a word, its reason
        is for the lines below the table (refusals())."""
        head = ["step", "predicted peak", "measured peak", "peak / eager", "step ms", "time / eager", "recomputed"]
        body = []
        for line in self.lines:
            if line.refused:
                why = "refused (see below)" if refusals_below else f"refused: {line.refused}"
                body.append([line.label, "", "", "", "", "", why])
                continue
            body.append([
                line.label, size_text(line.predicted_bytes) if line.predicted_bytes else "",
                size_text(line.peak_bytes), f"{line.peak_bytes / self.eager.peak_bytes:.2f}",
                f"{line.step_ms:.1f}", f"{line.step_ms / self.eager.step_ms:.2f}", line.recomputed])
        return [head] + body

    def refusals(self) -> list[tuple[str, str]]:
        """(label, the graphopt error that refused it) of each refused configuration."""
        return [(line.label, line.refused) for line in self.lines if line.refused]

    def to_text(self, refusals: bool = True) -> str:
        """The table, each refused configuration's reason below it; refusals=False leaves those
        to the caller (the command line writes them as errors)."""
        rows = self.rows(refusals_below=True)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
        budget = f"budget {size_text(self.budget_bytes)}" if self.budget_bytes else "no budget"
        below = [f"{label} refused: {why}" for label, why in self.refusals()] if refusals else []
        return "\n".join([f"{self.model}: one training step, {budget}", fmt(rows[0]),
                          "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows[1:]] + below)

    def to_markdown(self) -> str:
        rows = self.rows()
        budget = f"budget {size_text(self.budget_bytes)}" if self.budget_bytes else "no budget"
        lines = [f"# graphopt: {self.model}, one training step, {budget}", "",
                 "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows[1:]]
        lines += ["", "Measured in one run: peaks are live tensor bytes (CPU) or the allocator's peak (CUDA); "
                  "times are medians of steps run in turns. memory.png draws memory over each step."]
        if self.dumped:
            lines += ["", f"The pass-by-pass dumps beside this file (NN-pass.py, .txt, .diff) are the {self.dumped!r} "
                      "configuration's; the others are in the table only."]
        for label, report in self.reports.items():
            lines += ["", f"## passes: {label}", "", report.split("\n", 2)[-1]]
        return "\n".join(lines) + "\n"

    def summary(self) -> dict:
        optimized = self.optimized
        return {
            "model": self.model,
            "budget_bytes": self.budget_bytes,
            "eager_peak_bytes": self.eager.peak_bytes,
            "eager_step_ms": self.eager.step_ms,
            "optimized_peak_bytes": optimized.peak_bytes if optimized else None,
            "optimized_predicted_peak_bytes": optimized.predicted_bytes if optimized else None,
            "optimized_step_ms": optimized.step_ms if optimized else None,
            "lines": [asdict(line) for line in self.lines],
        }

    def write(self, directory) -> list[Path]:
        """summary.json, summary.md and memory.png (memory over the step) into `directory`."""
        from ..reporting.plot import step_memory_png

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(self.summary(), indent=2) + "\n")
        (out / "summary.md").write_text(self.to_markdown())
        (out / "memory.png").write_bytes(step_memory_png(self.timelines, self.budget_bytes))
        return [out / "summary.json", out / "summary.md", out / "memory.png"]


def _recomputed(report) -> str:
    record = report.recompute()
    stats = record.stats if record is not None else None
    if not stats or not stats.get("segments"):
        return "nothing" if stats is not None else ""
    return (f"{stats['recomputed_nodes']} nodes in {stats['segments']} segments "
            f"(+{stats['recompute_overhead_pct']}% of the step's estimated time)")


def measure(model: torch.nn.Module, args: tuple, kwargs: dict | None, configs: dict[str, dict], *,
            loss_fn: Callable | None = None, budget_bytes: int | None = None, name: str | None = None,
            progress: Callable[[str], None] = lambda text: None, repeats: int = 5,
            dump_dir=None) -> BeforeAfter:
    """Eager and each configuration of optimize() (label -> its options) on the same step:
    optimized, then measured (peak, memory over the step, time) beside eager in one run. A
    configuration graphopt refuses is a line saying why. dump_dir: the first configuration's
    pass-by-pass dumps go there (result.dumped names it)."""
    from ..api import optimize

    kwargs = kwargs or {}
    result = BeforeAfter(name or type(model).__name__, budget_bytes)
    result.dumped = next(iter(configs), None) if dump_dir else None
    modules = {"eager": model}
    result.lines.append(Line("eager", {}))
    for k, (label, options) in enumerate(configs.items(), 1):
        progress(f"[{k}/{len(configs)}] optimizing: {label}")
        line = Line(label, dict(options))
        start = time.perf_counter()
        try:
            opt = optimize(model, args, example_kwargs=kwargs or None,
                           dump_dir=dump_dir if k == 1 else None, **options)
        except GraphoptError as e:
            line.refused = f"{type(e).__name__}: {e}"
            result.lines.append(line)
            continue
        line.optimize_s = time.perf_counter() - start
        report = opt.graphopt_report
        line.predicted_bytes = next((r.peak_bytes for r in reversed(report.passes) if r.peak_bytes), None)
        line.recomputed = _recomputed(report)
        result.reports[label] = report.to_markdown()
        modules[label] = opt
        result.lines.append(line)
    progress("measuring memory over each step")
    for line in result.lines:
        if not line.refused:
            module = modules[line.label]
            line.peak_bytes = step_peak(module, model, args, kwargs, loss_fn)
            result.timelines[line.label] = step_timeline(module, model, args, kwargs, loss_fn)
    progress(f"timing the steps in turns ({repeats} rounds)")
    def timed(module):
        def step():
            clear_grads(model)
            run_step(module, args, kwargs, loss_fn)
        return step

    seconds = step_seconds({label: timed(module) for label, module in modules.items()}, repeats)
    clear_grads(model)
    for line in result.lines:
        if not line.refused:
            line.step_ms = seconds[line.label] * 1e3
    return result
