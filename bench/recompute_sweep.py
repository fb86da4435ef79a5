"""Recompute on the real-model corpus: peak and step time from graphopt's least budget to eager.

    python bench/recompute_sweep.py [--models a,b] [--points 9] [--device cpu|cuda] [--out DIR] [--keep]
    make sweep

Per model (tests/corpus, at the memory tests' batch, corpus/memory.py): the eager step's
measured peak and time; graphopt's least budget (what its BudgetError names); POINTS budgets
from that least to the eager peak, each with graphopt's predicted and measured peak and its
step time over eager's (medians of 7 steps, run in turns with eager's); and the model's own
checkpointing (transformers' gradient_checkpointing_enable(), timm's set_grad_checkpointing())
as a reference point, timed in turns with eager and graphopt at its peak, with graphopt planned at its measured peak. Recompute FLOPs are the step's
matmul and convolution FLOPs (torch.utils.flop_counter) less eager's. Writes
DIR/<model>.png (peak and time against the budget), DIR/points.csv and DIR/README.md (the
table); the default DIR is bench/results/recompute_sweep-<device>. --keep remeasures the models
named and keeps the other models' rows DIR/points.csv holds.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # graphopt from this checkout, and the corpus


def sweep_model(name: str, points: int, device: str) -> dict:
    import graphopt
    from corpus.memory import (memory_case, optimized_point, own_checkpointing, own_checkpointing_step, step_flops,
                               user_step, user_step_peak)
    from graphopt.runtime.step import step_seconds
    from least_budget import least_bytes  # bench/, beside this script

    case = memory_case(name)
    if device != "cpu":
        case.model.to(device)
        case.args, case.kwargs = _to(case.args, device), _to(case.kwargs, device)
        case.loss = _loss_to(case.loss, device)
    eager_peak, eager_flops = user_step_peak(case.model, case), step_flops(case.model, case)
    eager = user_step(case.model, case)

    def row(kind, point, opt) -> dict:
        timed = step_seconds({"eager": eager, "opt": user_step(opt, case)}) if opt is not None else None
        return {"model": name, "kind": kind, "budget": point.budget, "predicted": point.predicted or "",
                "measured": point.measured or "",
                "time_ratio": round(timed["opt"] / timed["eager"], 3) if timed else "",
                "recompute_gflops": round((step_flops(opt, case) - eager_flops) / 1e9, 4) if opt is not None else "",
                "recomputed": point.recomputed if opt is not None else "", "refused": point.refused}

    least = least_bytes(case.model, case.args, case.kwargs)
    rows = []
    budgets = [int(least + (eager_peak - least) * k / (points - 1)) for k in range(points)]
    for k, budget in enumerate(budgets):
        rows.append(row("graphopt", *optimized_point(case, f"{k}", budget)))
    own, own_peak, own_flops = own_checkpointing_step(case)
    own_row = None
    if own:
        point, opt = optimized_point(case, "at own", own_peak)
        at_own = row("graphopt at own's peak", point, opt)
        # the three in turns: the two ratios share one eager baseline
        timed = step_seconds({"eager": eager, "own": user_step(case.model, case, own_checkpointing),
                              **({"graphopt": user_step(opt, case)} if opt is not None else {})})
        if opt is not None:
            at_own["time_ratio"] = round(timed["graphopt"] / timed["eager"], 3)
        own_row = {"model": name, "kind": own, "budget": own_peak, "predicted": "", "measured": own_peak,
                   "time_ratio": round(timed["own"] / timed["eager"], 3),
                   "recompute_gflops": round((own_flops - eager_flops) / 1e9, 4), "recomputed": "", "refused": ""}
        rows += [at_own, own_row]
    return {"name": name, "eager_peak": eager_peak, "least": least, "rows": rows, "own": own_row}


def _to(value, device):
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), value)


def _loss_to(loss, device):
    if hasattr(loss, "targets"):
        return type(loss)(loss.targets.to(device))
    return loss


def picture(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mb = 1e6
    fitted = [r for r in result["rows"] if r["kind"] == "graphopt" and r["measured"] != ""]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True, dpi=100)
    budgets = [r["budget"] / mb for r in fitted]
    top.plot(budgets, [r["measured"] / mb for r in fitted], "o-", label="graphopt, measured")
    top.plot(budgets, [r["predicted"] / mb for r in fitted], "x--", label="graphopt, predicted")
    span = [result["least"] / mb, result["eager_peak"] / mb]
    top.plot(span, span, ":", color="grey", label="budget")
    top.axhline(result["eager_peak"] / mb, color="black", linewidth=0.8, label="eager")
    bottom.plot(budgets, [r["time_ratio"] for r in fitted], "o-", label="graphopt")
    bottom.axhline(1.0, color="black", linewidth=0.8, label="eager")
    own = result["own"]
    if own:
        top.plot([own["budget"] / mb], [own["measured"] / mb], "*", markersize=12, color="crimson", label=own["kind"])
        bottom.plot([own["budget"] / mb], [own["time_ratio"]], "*", markersize=12, color="crimson", label=own["kind"])
    top.set_ylabel("peak of one step (MB)")
    bottom.set_ylabel("step time / eager")
    bottom.set_xlabel("budget_gb (MB)")
    top.set_title(f"{result['name']}: recompute from graphopt's least budget to eager")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def table(results: list[dict], device: str) -> str:
    mb = 1e6
    lines = [
        f"# Recompute sweep on the real-model corpus ({device})",
        "",
        f"Generated {datetime.date.today()} by `python bench/recompute_sweep.py` on {platform.machine()} "
        f"with torch {torch.__version__}; one PNG per model beside this file. Peaks are measured "
        "(live tensor storages on CPU, torch.cuda.max_memory_allocated on CUDA); times are medians "
        "of 7 steps over eager's, the steps run in turns; at own's peak eager, own and graphopt take turns.",
        "",
        "| model | eager peak | graphopt least | own checkpointing peak | least / own | at own's peak, step time "
        "over eager: graphopt / own | at own's peak, recompute GFLOPs: graphopt / own | worst estimate error "
        "| budgets overshot |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        fitted = [row for row in r["rows"] if row["measured"] != "" and row["predicted"] != ""]
        worst = max((abs(row["predicted"] - row["measured"]) / row["measured"] for row in fitted), default=0)
        over = sum(row["measured"] > row["budget"] for row in fitted)
        own = r["own"]
        at_own = next((row for row in r["rows"] if row["kind"] == "graphopt at own's peak"), None)
        own_cells = ["-", "-", "-", "-"]
        if own:
            fitted_at_own = at_own is not None and at_own["time_ratio"] != ""
            time_cell = f"{at_own['time_ratio']:.2f} / {own['time_ratio']:.2f}" if fitted_at_own else "refused"
            flops_cell = f"{at_own['recompute_gflops']:.3f} / {own['recompute_gflops']:.3f}" if fitted_at_own else "-"
            own_cells = [f"{own['measured'] / mb:.2f} MB", f"{r['least'] / own['measured']:.2f}", time_cell, flops_cell]
        lines.append(f"| {r['name']} | {r['eager_peak'] / mb:.2f} MB | {r['least'] / mb:.2f} MB | "
                     + " | ".join(own_cells) + f" | {100 * worst:.2f}% | {over} |")
    return "\n".join(lines) + "\n"


def read_points(path: str) -> list[dict]:
    """The results a points.csv holds, per model in its order: what table() and picture() take."""
    numeric = ("budget", "predicted", "measured", "time_ratio", "recompute_gflops", "recomputed")
    by_model: dict[str, list[dict]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for key in numeric:
                row[key] = "" if row[key] == "" else float(row[key]) if "." in row[key] else int(row[key])
            by_model.setdefault(row["model"], []).append(row)
    results = []
    for name, rows in by_model.items():
        budgets = [r["budget"] for r in rows if r["kind"] == "graphopt"]
        own = next((r for r in rows if not r["kind"].startswith("graphopt")), None)
        results.append({"name": name, "eager_peak": max(budgets), "least": min(budgets), "rows": rows, "own": own})
    return results


def main(argv=None) -> int:
    from corpus import CORPUS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CORPUS))
    parser.add_argument("--points", type=int, default=9)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    parser.add_argument("--keep", action="store_true",
                        help="keep the other models' rows of OUT/points.csv: the table holds them and these, remeasured")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(ROOT, "bench", "results", f"recompute_sweep-{args.device}")
    os.makedirs(out, exist_ok=True)
    earlier = read_points(os.path.join(out, "points.csv")) if args.keep and os.path.exists(os.path.join(out, "points.csv")) else []
    results = []
    for name in args.models.split(","):
        result = sweep_model(name, args.points, args.device)
        results.append(result)
        picture(result, os.path.join(out, f"{name}.png"))
        print(table([result], args.device).splitlines()[-1], flush=True)
    fresh = {r["name"]: r for r in results}
    order = [r["name"] for r in earlier] + [n for n in fresh if n not in {r["name"] for r in earlier}]
    results = [fresh.get(n) or next(r for r in earlier if r["name"] == n) for n in order]
    with open(os.path.join(out, "points.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]["rows"][0]))
        writer.writeheader()
        for r in results:
            writer.writerows(r["rows"])
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(table(results, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
