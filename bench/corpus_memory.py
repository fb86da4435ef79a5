"""Predicted against measured peak of one training step, per real-model corpus model.

    python bench/corpus_memory.py [--models a,b]

The measured step is the user's (corpus/memory.user_step_peak: forward, the case's loss,
backward, gradients None before). The prediction is memory.estimate_peak of
the graph the default passes give. Printed as a table with the error in percent.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main(argv=None) -> int:
    import graphopt
    from corpus import CORPUS, build
    from corpus.memory import user_step_peak
    from graphopt.analysis.memory import estimate_peak, size_text
    from graphopt.frontend.graph_inputs import placeholder_values

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CORPUS))
    args = parser.parse_args(argv)
    print("| model | frontend | predicted | measured eager | measured graph | error vs graph |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        case = build(name)
        opt = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs)
        predicted = estimate_peak(opt, placeholder_values(opt, case.args, case.kwargs)).peak_bytes
        eager, graph = user_step_peak(case.model, case), user_step_peak(opt, case)
        print(f"| {name} | {opt.graphopt_report.frontend} | {size_text(predicted)} | {size_text(eager)} | "
              f"{size_text(graph)} | {100 * (predicted - graph) / graph:+.1f}% |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
