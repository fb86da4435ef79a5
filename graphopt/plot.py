"""Pictures of a step's predicted memory, for the dumps (matplotlib, the viz extra)."""
from __future__ import annotations

import io

from .analysis.memory import GB, Estimate


def memory_csv(curves: dict[str, Estimate]) -> str:
    """Every event of each curve: live bytes after it."""
    lines = ["curve,index,event,live_bytes"]
    for label, estimate in curves.items():
        lines += [f"{label},{k},{event.replace(',', ';')},{live}" for k, (event, live) in enumerate(estimate.timeline)]
    return "\n".join(lines) + "\n"


def memory_png(curves: dict[str, Estimate], budget_bytes: int | None = None) -> bytes | None:
    """Predicted live memory through the step, one line per curve; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: render to bytes
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    for label, estimate in curves.items():
        live = [b / GB * 1e3 for _, b in estimate.timeline]
        # Steps with recompute have more events: each curve spans the same width.
        x = [k / max(len(live) - 1, 1) for k in range(len(live))]
        line, = ax.plot(x, live, label=f"{label} (peak {estimate.peak_bytes / GB * 1e3:.2f} MB)", linewidth=1.2)
        start = next((k for k, (event, _) in enumerate(estimate.timeline) if not event.startswith(("forward", "free", "parameters", "buffers", "optimizer"))), None)
        if start is not None:
            ax.axvline(x[start], color=line.get_color(), linestyle=":", linewidth=0.8)
    if budget_bytes:
        ax.axhline(budget_bytes / GB * 1e3, color="black", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("progress through the step: forward, then backward (dotted: backward starts)")
    ax.set_ylabel("predicted live memory (MB, 10^6 bytes)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
