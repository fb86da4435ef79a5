"""The plans recompute chooses on corpus models, to compare two checkouts' searches.

    python bench/plan_choices.py [--models a,b] [--out FILE] [--against FILE]

Per model (tests/corpus, at the memory tests' batch, corpus/memory.py): the least budget
(BudgetError's, to the byte) and, at 10%, 50% and 85% of the way from it to the eager step's
measured peak, the chosen plan's segments, estimated recompute time, predicted peak and the
rewritten graph's code (an md5 of it), with the seconds each optimize() took. One JSON line per
model, also written to --out; --against a file written so by another checkout (the search
before a change) prints per model whether every figure but the seconds is the same.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # graphopt from this checkout, and the corpus

from least_budget import least_bytes  # noqa: E402  (bench/, beside this script)

DEFAULT = ("hf_llama,hf_gpt2,hf_bert,hf_t5,hf_phi,hf_mixtral,hf_gpt_neox,hf_whisper,hf_qwen2,hf_bart,hf_distilbert,"
           "hf_segformer,hf_deepseek_v3,hf_convnext,timm_densenet121,timm_efficientnet_b0,timm_vit_tiny_patch16_224,"
           "timm_regnetx_002,timm_mobilevit_xxs,timm_resnet18,tv_resnet18,tv_swin_t,tv_convnext_tiny")
FRACTIONS = (0.1, 0.5, 0.85)


def choices(name: str) -> dict:
    import graphopt
    from corpus.memory import memory_case
    from graphopt.runtime.step import step_peak

    case = memory_case(name)
    start = time.perf_counter()
    least = least_bytes(case.model, case.args, case.kwargs)
    row = {"model": name, "least": least, "least_s": round(time.perf_counter() - start, 2), "plans": []}
    peak = step_peak(case.model, case.model, case.args, case.kwargs, lambda out, *a, **k: case.loss(out))
    for f in FRACTIONS:
        start = time.perf_counter()
        try:
            graph = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs,
                                      budget_gb=(least + f * (peak - least)) / 1e9)
            record = graph.graphopt_report.recompute()
            stats = record.stats
            plan = {"f": f, "segments": stats.get("segments"), "recompute_ms": stats.get("recompute_ms"),
                    "predicted": record.peak_bytes,
                    "code": hashlib.md5(graph.code.encode()).hexdigest()[:8]}
        except graphopt.BudgetError as e:
            plan = {"f": f, "refused": e.min_budget_bytes}
        plan["s"] = round(time.perf_counter() - start, 2)
        row["plans"].append(plan)
    return row


def same(a: dict, b: dict) -> bool:
    """Every figure but the seconds."""
    strip = lambda plans: [{k: v for k, v in p.items() if k != "s"} for p in plans]  # noqa: E731
    return a["least"] == b["least"] and strip(a["plans"]) == strip(b["plans"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT, help="corpus models, comma-separated")
    parser.add_argument("--out", default=None, help="write the JSON lines into this file")
    parser.add_argument("--against", default=None, help="JSON lines of another checkout to compare with")
    args = parser.parse_args(argv)
    before = {}
    if args.against:
        with open(args.against) as f:
            before = {r["model"]: r for r in map(json.loads, f)}
    rows, differ = [], 0
    for name in args.models.split(","):
        row = choices(name)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if name in before:
            differ += not same(row, before[name])
            print(f"{name}: {'the same' if same(row, before[name]) else 'DIFFERENT'}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
