"""graphopt.train_step on the real-model corpus at a quarter budget: per model, the microbatches
it chooses and its measured peak against the budget, as a markdown table.

    python bench/train_step_corpus.py [--models a,b] [--out FILE]

Each model trains on 8 rows (the corpus batch repeated 4 times; image models take their
targets as an argument, read by a cross-entropy loss outside the model), dropout as the
library sets it. The budget is parameters + gradients + 0.25 x (eager's measured peak -
parameters - gradients); the measured step is train_step's call, gradients None before
(live tensor storages on CPU). A model refused even in microbatches of one row shows the
least budget the BudgetError names.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

F = 0.25
HEAD = ("| model | rows | eager peak | params + grads | budget | microbatches | measured peak | peak / budget "
        "| plan s | note |")


def row(name: str) -> str:
    import graphopt
    from graphopt.analysis.memory import GB, size_text
    from graphopt.runtime.step import step_peak
    from test_train_step import corpus_step_case, has_batchnorm, measured_peak

    model, args, kwargs, loss_fn = corpus_step_case(name, dropout=True)
    rows = int(args[0].shape[0])
    eager = step_peak(model, model, args, kwargs, loss_fn)
    fixed = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(fixed + F * (eager - fixed))
    start = time.perf_counter()
    cells = [name, str(rows), size_text(eager), size_text(fixed), size_text(budget)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the BatchNorm warning: the note says it
        try:
            step = graphopt.train_step(model, args, kwargs, loss_fn=loss_fn, budget_gb=budget / GB)
        except graphopt.BudgetError as e:
            least = int(e.min_budget_gb * GB)
            return "| " + " | ".join(cells + ["refused", "", "", f"{time.perf_counter() - start:.1f}",
                                              f"least {size_text(least)} ({least / budget:.2f} x budget)"]) + " |"
    seconds = time.perf_counter() - start
    peak = measured_peak(step, model, args, kwargs)
    note = "BatchNorm: statistics per microbatch" if has_batchnorm(model) and step.microbatches > 1 else ""
    return "| " + " | ".join(cells + [str(step.microbatches), size_text(peak), f"{peak / budget:.3f}",
                                      f"{seconds:.1f}", note]) + " |"


def main(argv=None) -> int:
    from corpus import CORPUS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CORPUS), help="comma-separated corpus names (default: all)")
    parser.add_argument("--out", help="also write the table to this file")
    options = parser.parse_args(argv)
    names = options.models.split(",")
    unknown = [n for n in names if n not in CORPUS]
    if unknown:
        parser.error(f"unknown corpus models: {', '.join(unknown)}; choose from {', '.join(CORPUS)}")
    lines = [HEAD, "|" + "---|" * HEAD.count(" | ") + "---|"]
    print("\n".join(lines), flush=True)
    for name in names:
        try:
            lines.append(row(name))
        except Exception as e:  # one model's failure is a row of the table, not the end of it
            first = (str(e).strip().splitlines() or [""])[0][:160]
            lines.append(f"| {name} |" + " |" * 8 + f" error: {type(e).__name__}: {first} |")
        print(lines[-1], flush=True)
    if options.out:
        with open(options.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
