"""Pictures of a step's memory, predicted (for the dumps) or measured (demo, --measure); matplotlib."""
from __future__ import annotations

import io

from ..analysis.live_storage import from_first_op
from ..analysis.memory import GB, Estimate


# How analysis/memory.py's step names what backward allocates: a node's backward, a segment's rerun.
BACKWARD_EVENTS = ("backward", "recompute")


def backward_start(timeline: list[tuple[str, int]]) -> int | None:
    """Index of the first backward event of an Estimate's timeline; None when backward never
    allocates (inference). Before it come the resident state (parameters, inputs, ...) and the forward."""
    return next((k for k, (event, _) in enumerate(timeline) if event.startswith(BACKWARD_EVENTS)), None)


def memory_csv(curves: dict[str, Estimate]) -> str:
    """Every event of each curve from its first op (the resident state one first event): live
    bytes after it, and its phase (forward until the backward_start, the dotted line of
    memory_png; backward from it)."""
    lines = ["curve,index,event,live_bytes,phase"]
    for label, estimate in curves.items():
        timeline = from_first_op(estimate.timeline)
        start = backward_start(timeline)
        lines += [f"{label},{k},{event.replace(',', ';')},{live},"
                  f"{'backward' if start is not None and k >= start else 'forward'}"
                  for k, (event, live) in enumerate(timeline)]
    return "\n".join(lines) + "\n"


def memory_png(curves: dict[str, Estimate], budget_bytes: int | None = None) -> bytes | None:
    """Predicted live memory through the step, one line per curve; None without matplotlib."""
    series = {}
    for label, estimate in curves.items():
        timeline = from_first_op(estimate.timeline)
        series[f"{label} (peak {estimate.peak_bytes / GB * 1e3:.2f} MB)"] = (
            [b for _, b in timeline], backward_start(timeline))
    return _chart(series, budget_bytes, "predicted live memory (MB, 10^6 bytes)",
                  "progress through the step from its first op: forward, then backward (dotted: backward starts)")


def step_memory_png(timelines: dict[str, list[int]], budget_bytes: int | None = None) -> bytes:
    """Measured live memory through one step, one line per configuration (runtime/step.step_timeline).
    matplotlib is a dependency of what calls this (the demo, --measure): it must be installed."""
    series = {f"{label} (peak {max(live) / GB * 1e3:.2f} MB)": (live, None) for label, live in timelines.items()}
    png = _chart(series, budget_bytes, "measured live memory (MB, 10^6 bytes)",
                 "progress through the step from its first op: forward, loss, backward")
    if png is None:
        from ..errors import UsageError

        raise UsageError("drawing memory.png needs matplotlib: pip install 'graphopt[viz]' (make installs it).")
    return png


def _chart(series: dict[str, tuple[list[int], int | None]], budget_bytes: int | None, ylabel: str,
           xlabel: str) -> bytes | None:
    """Lines of bytes over progress (each spanning the same width: a step with recompute has more
    events), each starting where its resident state is (shaded: what the lowest holds before the
    first op), a dotted mark at each line's given index, the budget dashed; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: render to bytes
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    resident = min(live[0] for live, _ in series.values())
    if resident:
        ax.axhspan(0, resident / GB * 1e3, color="grey", alpha=0.15, linewidth=0,
                   label=f"resident before the first op: parameters, buffers, inputs ({resident / GB * 1e3:.2f} MB)")
    for label, (live, mark) in series.items():
        x = [k / max(len(live) - 1, 1) for k in range(len(live))]
        line, = ax.plot(x, [b / GB * 1e3 for b in live], label=label, linewidth=1.2)
        if mark is not None:
            ax.axvline(x[mark], color=line.get_color(), linestyle=":", linewidth=0.8)
    if budget_bytes:
        ax.axhline(budget_bytes / GB * 1e3, color="black", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
