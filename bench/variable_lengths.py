"""Planning for a loader of several sequence lengths: what it costs beyond one plan.

    python bench/variable_lengths.py [--layers 8] [--lengths 256,96,192,128,224] [--out DIR]

transformers' Llama (bench/planning_time.py's: 256 wide, 4 x L tokens, its own loss on
labels=input_ids) at a budget halfway between the least budget and the unplanned peak of the
longest length. Timed in one process, each as a ratio to one plan (optimize with the longest
batch and the budget) measured just before:
  - the example form: that plan, then one step at each other length (each new length first
    estimates its step there: runtime/budget_check.py);
  - the lazy form (`optimize(model, budget_gb=...)`) stepping through the lengths in each
    order given: longest first, longest in the middle, increasing (a plan for each length
    its plans so far cannot take);
and before this change, the lazy form planned (and exported) once per length: the sum of one
optimize() per length.
Each run's overhead is its loader pass less the same pass again (every graph built and checked
by then): the time spent planning and checking. With --out DIR, writes
variable_lengths-<device>-<date>.json and .md there (results_files.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from least_budget import least_bytes  # noqa: E402  (bench/, beside this script)
from planning_time import llama  # noqa: E402
from results_files import device_name, today, write_results  # noqa: E402


def batch(length: int):
    ids = torch.randint(0, 1024, (4, length))
    return (ids,), {"labels": ids}


def main(argv=None) -> int:
    import graphopt
    from graphopt.analysis.memory import GB
    from graphopt.runtime.step import clear_grads, step_peak

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lengths", default="256,96,192,128,224", help="the loader's lengths, longest first")
    parser.add_argument("--out", default=None)
    options = parser.parse_args(argv)
    lengths = [int(n) for n in options.lengths.split(",")]
    longest = max(lengths)
    name, model, _, _, _ = llama(options.layers)
    args, kwargs = batch(longest)
    peak = step_peak(model, model, args, kwargs, lambda out, *a, **k: out.loss)
    least = least_bytes(model, args, kwargs)
    budget_gb = (least + peak) / 2 / GB

    def step(module, length):
        a, k = batch(length)
        clear_grads(model)
        module(*a, **k).loss.backward()
        clear_grads(model)

    def loader(module, order) -> float:
        start = time.perf_counter()
        for n in order:
            step(module, n)
        return time.perf_counter() - start

    def plan(length) -> tuple[float, object]:
        a, k = batch(length)
        start = time.perf_counter()
        opt = graphopt.optimize(model, a, example_kwargs=k, budget_gb=budget_gb)
        return time.perf_counter() - start, opt

    one_plan, opt = plan(longest)
    others = [n for n in lengths if n != longest]
    first = loader(opt, others)
    rows = [{"run": f"example form: plan at {longest}, then {', '.join(map(str, others))}",
             "plans": 1, "overhead_s": one_plan + first - loader(opt, others)}]
    middle = lengths[1:len(lengths) // 2 + 1] + [longest] + lengths[len(lengths) // 2 + 1:]
    for label, order in (("longest first", lengths), ("longest in the middle", middle),
                         ("increasing", sorted(lengths))):
        lazy = graphopt.optimize(model, budget_gb=budget_gb)
        first = loader(lazy, order)
        rows.append({"run": f"lazy form, {label}: {', '.join(map(str, order))}", "plans": lazy._builds,
                     "overhead_s": first - loader(lazy, order)})
    before = sum(plan(n)[0] for n in lengths)
    rows.append({"run": "lazy form before this change: a plan and an export per length", "plans": len(lengths),
                 "overhead_s": before})
    for r in rows:
        r["ratio"] = r["overhead_s"] / one_plan
    result = {"device": device_name(), "date": today(), "torch": torch.__version__, "model": name,
              "lengths": lengths, "budget_gb": budget_gb, "least_gb": least / GB, "peak_gb": peak / GB,
              "one_plan_s": one_plan, "rows": rows}
    lines = [f"# A loader of {len(lengths)} lengths (bench/variable_lengths.py)", "",
             f"{result['device']}, torch {result['torch']}, {result['date']}", "",
             f"{name} (transformers LlamaForCausalLM, 256 wide), 4 x L tokens, budget {budget_gb * 1e3:.1f} MB "
             f"(halfway between the least, {least / 1e6:.1f} MB, and the unplanned peak, {peak / 1e6:.1f} MB, "
             f"at {longest}); one plan at {longest}: {one_plan:.1f} s", "",
             "| run | plans | planning and checks | / one plan |", "|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['plans']} | {r['overhead_s']:.1f} s | {r['ratio']:.2f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if options.out:
        write_results("variable_lengths", result, text, options.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
