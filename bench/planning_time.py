"""Planning time against graph size: optimize() in seconds and in eager steps of the same model.

    python bench/planning_time.py [--layers 2,4,8,16,32] [--models timm_densenet121,...]
        [--timm maxvit_tiny_tf_224,...] [--train-step LAYERS [--train-rows 4]] [--out DIR]

Per model: its graph's nodes (as traced), the median of 3 eager training steps, then timed once
each: optimize() with the default passes; optimize(budget_gb=1e-9), which plans down to the least
budget and refuses with it (BudgetError); and optimize() at a budget halfway between that least
and the unplanned step's peak. The transformers Llama family is 256 wide (4 heads, 1024 MLP,
vocabulary 1024) at 4 x 256 tokens with its own loss on labels=input_ids, at each depth in
--layers; --models adds corpus models at the memory tests' batch, --timm timm models at their
defaults on 8 x 3 x 64 x 64 images with cross-entropy. Each time is also a ratio to
one eager step measured in the same process just before, so that a busy machine slows both.
--train-step L adds graphopt.train_step choosing its microbatches for the L-layer Llama at
budgets 5% above the least of 2 and of 4 microbatches of a batch of --train-rows rows (4: the
microbatches of k = 4 are single rows, which export takes as constants and traces again), against
one optimize() at the k it chose, each in a fresh process, two of each in turn (medians).
With --out DIR, writes planning_time-<device>-<date>.json and .md there (results_files.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

os.environ.setdefault("GRAPHOPT_PLAN_CACHE", "off")  # planning time from cold: every plan made afresh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # graphopt from this checkout, and the corpus

from least_budget import least_bytes  # noqa: E402  (bench/, beside this script)
from results_files import device_name, today, write_results  # noqa: E402


def llama(layers: int, rows: int = 4):
    """(name, model, args, kwargs, loss) of the Llama at one depth, on rows x 256 tokens."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=256, use_cache=False)
    ids = torch.randint(0, 1024, (rows, 256))
    return f"llama-{layers}", transformers.LlamaForCausalLM(config), (ids,), {"labels": ids}, lambda out: out.loss


def corpus_model(name: str):
    from corpus.memory import memory_case

    case = memory_case(name)
    return name, case.model, case.args, case.kwargs, case.loss


def timm_model(name: str):
    """A timm model at its defaults (10 classes) on 8 x 3 x 64 x 64 images, cross-entropy."""
    from corpus.vision_import import import_torchvision

    import_torchvision()
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, img_size=64).train()
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    return name, model, (x,), {}, lambda out: torch.nn.functional.cross_entropy(out, y)


def measure(name, model, args, kwargs, loss) -> dict:
    import graphopt
    from graphopt.analysis.memory import GB
    from graphopt.runtime.step import clear_grads, step_peak

    def eager_step():
        clear_grads(model)
        loss(model(*args, **kwargs)).backward()
        clear_grads(model)

    def timed(fn):
        start = time.perf_counter()
        try:
            result = fn()
        except graphopt.BudgetError as e:
            result = e
        return time.perf_counter() - start, result

    eager_step()
    eager = statistics.median(timed(eager_step)[0] for _ in range(3))
    default_s, opt = timed(lambda: graphopt.optimize(model, args, example_kwargs=kwargs))
    nodes = sum(1 for n in opt.graph.nodes if n.op == "call_function")
    peak = step_peak(model, model, args, kwargs, lambda out, *a, **k: loss(out))
    least_s, least = timed(lambda: least_bytes(model, args, kwargs))
    budget = (least + peak) / 2
    plan_s, _ = timed(lambda: graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=budget / GB))
    return {"model": name, "nodes": nodes, "eager_s": eager, "default_s": default_s, "least_s": least_s,
            "plan_s": plan_s, "least_mb": least / 1e6, "budget_mb": budget / 1e6, "peak_mb": peak / 1e6}


def train_step_choice(layers: int, rows: int = 4) -> list[dict]:
    """graphopt.train_step choosing k for the Llama at one depth, at budgets 5% above the least
    of 2 and of 4 microbatches of its batch of `rows`, against one optimize() at the k it chose: each
    timed in a fresh process (FakeTensor's caches and the machine's pace alike for both), two
    pairs in turn, the medians compared."""
    name, model, (ids,), _, _ = llama(layers, rows)
    found = []
    for k in (2, 4):
        part = ids[:len(ids) // k]
        budget = least_bytes(model, (part,), {"labels": part}, accumulate=k > 1) * 1.05 / 1e9
        chose, plan = [], []
        for _ in range(2):
            chosen_k, seconds = _in_process("train_step", layers, rows, budget, 0)
            chose.append(seconds)
            plan.append(_in_process("plan", layers, rows, budget, chosen_k)[1])
        found.append({"model": f"{name}, {rows} rows", "budget_mb": budget * 1e3, "k": chosen_k,
                      "train_step_s": statistics.median(chose), "plan_s": statistics.median(plan),
                      "train_step_runs": chose, "plan_runs": plan})
    return found


def _in_process(what: str, layers: int, rows: int, budget_gb: float, k: int) -> tuple[int, float]:
    """(k, seconds) of one train_step (k its choice) or one optimize() at k, in a process of its own."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", what, str(layers), str(rows),
                          repr(budget_gb), str(k)], check=True, capture_output=True, text=True).stdout.split()
    return int(out[-2]), float(out[-1])


def _one(what: str, layers: int, rows: int, budget_gb: float, k: int) -> None:
    import graphopt

    _, model, (ids,), _, _ = llama(layers, rows)
    start = time.perf_counter()
    if what == "train_step":
        k = graphopt.train_step(model, (ids,), {"labels": ids}, budget_gb=budget_gb).microbatches
    else:
        part = ids[:len(ids) // k]
        graphopt.optimize(model, (part,), example_kwargs={"labels": part}, budget_gb=budget_gb, accumulate=k > 1)
    print(k, time.perf_counter() - start)


def train_step_table(rows: list[dict]) -> str:
    lines = ["| model | budget | k chosen | train_step | one plan at k | ratio |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['budget_mb']:.1f} MB | {r['k']} | {r['train_step_s']:.1f} s | {r['plan_s']:.1f} s | "
              f"{r['train_step_s'] / r['plan_s']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def table(rows: list[dict]) -> str:
    lines = ["| model | call nodes | eager step | optimize() | least (BudgetError) | plan at halfway | "
             "plan / eager step | least, budget, peak |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['nodes']:,} | {r['eager_s']:.3f} s | {r['default_s']:.1f} s | "
                     f"{r['least_s']:.1f} s | {r['plan_s']:.1f} s | {r['plan_s'] / r['eager_s']:.0f} | "
                     f"{r['least_mb']:.1f}, {r['budget_mb']:.1f}, {r['peak_mb']:.1f} MB |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:  # one side of train_step_choice's comparison
        _one(argv[1], int(argv[2]), int(argv[3]), float(argv[4]), int(argv[5]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,4,8,16,32", help="Llama depths, comma-separated ('' for none)")
    parser.add_argument("--models", default="", help="corpus models, comma-separated")
    parser.add_argument("--timm", default="", help="timm models by name (8 x 3 x 64 x 64), comma-separated")
    parser.add_argument("--train-step", type=int, default=0, metavar="LAYERS",
                        help="also train_step's choice of microbatches for the Llama of this depth")
    parser.add_argument("--train-rows", type=int, default=4, help="the batch train_step splits, in rows")
    parser.add_argument("--out", default=None, help="write the figures into this folder")
    args = parser.parse_args(argv)
    builders = [lambda k=int(k): llama(k) for k in args.layers.split(",") if k]
    builders += [lambda m=m: corpus_model(m) for m in args.models.split(",") if m]
    builders += [lambda m=m: timm_model(m) for m in args.timm.split(",") if m]
    rows = []
    for build in builders:
        rows.append(measure(*build()))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    result = {"device": device_name(), "date": today(), "torch": torch.__version__, "rows": rows}
    text = (f"# Planning time (bench/planning_time.py)\n\n{result['device']}, torch {result['torch']}, "
            f"{result['date']}\n\n" + table(rows))
    if args.train_step:
        result["train_step"] = train_step_choice(args.train_step, args.train_rows)
        text += "\ntrain_step's choice of microbatches against one plan at the k it chose:\n\n" + \
            train_step_table(result["train_step"])
    print(text)
    if args.out:
        write_results("planning_time", result, text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
