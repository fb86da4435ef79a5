"""The recompute pass's whole measurement in one call, for a GPU machine (CPU works too, slowly).

    python bench/gpu_recompute.py --out bench/results          # writes recompute-<device>-<date>.{json,md}
    ... --models mlp,convnet --steps 3                          # less of it (a busy CPU: the GPT's plans take longest)

Needs only torch (and numpy, networkx) importable: graphopt is taken from this checkout.
Figures: estimate error per zoo model; measured peak / budget, recompute share and step time
at f = 0.3, 0.5, 0.7 of the way from graphopt's least budget to the estimated peak (--span state: f of
the peak beyond parameters and gradients, the CPU benchmark's budgets), the GPT also against
checkpointing every block by hand; the GPT at the hand-written plan's measured peak; solver time at
2,000 nodes. See recompute_figures.py.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402

import recompute_figures as rf  # noqa: E402
from graphopt.errors import OptionError  # noqa: E402
from results_files import device_name, today, write_results  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results"), help="directory for the .json and .md files")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per configuration (median)")
    parser.add_argument("--models", default=",".join(rf.SIZES),
                        help="comma-separated zoo models (default: all; only the GPT is set against hand checkpoints)")
    parser.add_argument("--span", choices=("least", "state"), default="least",
                        help="f of the way from graphopt's least budget to the estimated peak (default), or f of "
                             "the peak beyond parameters and gradients (the CPU benchmark's budgets)")
    options = parser.parse_args()
    models = options.models.split(",")
    if set(models) - set(rf.SIZES):
        raise OptionError(f"--models {options.models}: no zoo model {', '.join(sorted(set(models) - set(rf.SIZES)))} "
                          f"here; name some of {', '.join(rf.SIZES)}")

    started = time.perf_counter()
    rows = {"estimate_error": {}, "budgets": {}, "at_hand_memory": None,
            "solver_s_2000_nodes": round(min(rf.solver_time(2000) for _ in range(3)), 3)}

    planned = models + (["at hand memory"] if "gpt" in models else [])

    def save(done: list[str]) -> None:
        """Written after each model, so that a run stopped at a time limit still leaves what it measured."""
        result = {"device": device_name(), "date": today(), "torch": torch.__version__,
                  "models": {name: rf.SIZES[name] for name in models}, "planned": planned, "done": done,
                  "seconds": round(time.perf_counter() - started, 1), **rows}
        paths = write_results("recompute", result, markdown(result), options.out)
        print("wrote", *paths, flush=True)

    for k, name in enumerate(models):
        rows["estimate_error"][name] = rf.estimate_error(name)
        print("estimate", name, rows["estimate_error"][name], flush=True)
        for f in (0.3, 0.5, 0.7):
            rows["budgets"][f"{name} f={f}"] = rf.budget_run(name, f, options.steps, options.span)
            print("budget", name, f, rows["budgets"][f"{name} f={f}"], flush=True)
        save(planned[:k + 1])
    if "gpt" in models:
        rows["at_hand_memory"] = rf.at_hand_memory(options.steps)
        print("at hand memory", rows["at_hand_memory"], flush=True)
        save(planned)


def markdown(result: dict) -> str:
    lines = [f"# recompute on {result['device']} ({result['date']}, torch {result['torch']})", ""]
    left = [part for part in result["planned"] if part not in result["done"]]
    if left:
        lines += [f"Partial: written after {', '.join(result['done'])}; {', '.join(left)} not measured yet.", ""]
    lines += ["| model | estimate MB | measured MB | error |", "|---|---|---|---|"]
    for name, r in result["estimate_error"].items():
        lines.append(f"| {name} | {r['estimate_mb']} | {r['measured_mb']} | {r['error_pct']:+}% |")
    spans = {r.get("span") for r in result["budgets"].values()}
    lines += ["", "Budgets: f of the way from graphopt's least budget to the estimated peak." if spans == {"least"}
              else "Budgets: f of the step's peak beyond parameters and gradients."]
    lines += ["", "| model, f | result | measured / budget | recompute % of step | step time vs none | "
              "hand: measured / budget | FLOPs vs hand | hand: step time vs none |", "|---|---|---|---|---|---|---|---|"]
    for key, r in result["budgets"].items():
        if r["result"] != "fits":
            lines.append(f"| {key} | BudgetError (min {r['min_budget_mb']} MB vs {r['budget_mb']} MB) | | | | | | |")
            continue
        lines.append(f"| {key} | fits ({r['segments']} segments, {r['selective']} selective) | "
                     f"{r['measured_over_budget']} | {r['recompute_pct']} | {r['step_time_vs_plain']}x | "
                     f"{r.get('hand_measured_over_budget', '')} | {r.get('recompute_flops_over_hand', '')} | "
                     f"{r.get('hand_step_time_vs_plain', '')} |")
    h = result["at_hand_memory"]
    if h is not None:
        lines += ["", f"GPT at the hand-checkpointed plan's measured peak ({h['hand_peak_mb']} MB): measured "
                  f"{h['measured_over_hand']} of it, recompute FLOPs {h['recompute_flops_over_hand']} of hand's, "
                  f"step time {h['step_time_over_hand']}x hand's."]
    lines += ["", f"Solver: {result['solver_s_2000_nodes']} s at 2,000 nodes.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
