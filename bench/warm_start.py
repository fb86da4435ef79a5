"""A training script's second start: graphopt's plan cache against torch.compile's caches.

    python bench/warm_start.py [--layers 8] [--budget-fraction 0.5] [--compile-layers 4]
        [--plan-layers 32 --plan-width 4096] [--out DIR]

Each start is a fresh process, as a training script's is; each measures one eager training
step of the same model first (the median of 3, after one warm-up), and reports its times as
ratios to that step, so that a busy machine slows both:
- graphopt: optimize(model, ..., budget_gb=B) and the first optimized step, with an empty plan
  cache (cold), then again on the cache the first left (warm). B is --budget-fraction of the
  way from parameters and gradients to eager's measured peak.
- graphopt.plan for a Llama shape on the meta device (--plan-layers, --plan-width), cold and warm.
- torch.compile: the first compiled step (compiling forward and backward), with empty Inductor
  and AOTAutograd caches (cold), then on the caches the first left (warm), at --compile-layers
  (Inductor on CPU builds C++ kernels: minutes at the depths graphopt plans in seconds).
The transformers Llama is bench/planning_time.py's (256 wide, 4 x 256 tokens, its own loss).
With --out DIR, writes warm_start-<device>-<date>.json and .md there (results_files.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from results_files import device_name, today, write_results  # noqa: E402


def eager_step_s(model, args, kwargs) -> float:
    def once():
        start = time.perf_counter()
        model(*args, **kwargs).loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start
    once()
    return statistics.median(once() for _ in range(3))


def start_graphopt(layers: int, fraction: float, cache: str) -> dict:
    import torch

    import graphopt
    from planning_time import llama

    _, model, args, kwargs, _ = llama(layers)
    eager = eager_step_s(model, args, kwargs)
    plain = graphopt.measure_step(model, args, kwargs)
    resident = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = (resident + fraction * (plain.peak_bytes - resident)) / 1e9
    start = time.perf_counter()
    opt = graphopt.optimize(model, args, kwargs, budget_gb=budget, plan_cache=cache)
    planned = time.perf_counter() - start
    opt(*args, **kwargs).loss.backward()
    first = time.perf_counter() - start
    record = opt.graphopt_report.recompute()
    return {"eager_step_s": eager, "optimize_s": planned, "first_step_s": first, "budget_gb": budget,
            "trace_s": opt.graphopt_report.trace_ms / 1e3, "plan_cache": record.stats.get("plan_cache"),
            "torch_threads": torch.get_num_threads()}


def start_plan(layers: int, width: int, cache: str) -> dict:
    import torch
    import transformers

    import graphopt

    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=width, intermediate_size=int(width * 3.5),
                                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                      max_position_embeddings=2048, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, 128256, (1, 2048), device="meta")
    start = time.perf_counter()
    answer = graphopt.plan(model, (ids,), {"labels": ids}, budget_gb=80, device="cuda", optimizer="adamw",
                           plan_cache=cache)
    return {"plan_s": time.perf_counter() - start, "fits": answer.fits}


def start_compile(layers: int, cache: str) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the FX graph and AOTAutograd caches live under it
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    import torch

    from planning_time import llama

    _, model, args, kwargs, _ = llama(layers)
    eager = eager_step_s(model, args, kwargs)
    compiled = torch.compile(model)
    start = time.perf_counter()
    compiled(*args, **kwargs).loss.backward()
    return {"eager_step_s": eager, "first_step_s": time.perf_counter() - start}


KINDS = {"graphopt": start_graphopt, "plan": start_plan, "compile": start_compile}


def in_process(kind: str, *argv) -> dict:
    """One start in a fresh process: its JSON line."""
    out = subprocess.run([sys.executable, __file__, "--start", kind, *map(str, argv)], capture_output=True,
                         text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--budget-fraction", type=float, default=0.5)
    parser.add_argument("--compile-layers", type=int, default=4, help="0: no torch.compile rows")
    parser.add_argument("--plan-layers", type=int, default=0, help="graphopt.plan on a Llama shape; 0: none")
    parser.add_argument("--plan-width", type=int, default=4096)
    parser.add_argument("--out", default=None)
    parser.add_argument("--start", nargs="+", help=argparse.SUPPRESS)  # a child process: one start
    a = parser.parse_args()
    if a.start:
        kind, *argv = a.start
        casts = {"graphopt": (int, float, str), "plan": (int, int, str), "compile": (int, str)}[kind]
        print(json.dumps(KINDS[kind](*[c(v) for c, v in zip(casts, argv)])))
        return
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for when in ("cold", "warm"):
            r = in_process("graphopt", a.layers, a.budget_fraction, os.path.join(cache, "graphopt"))
            rows.append({"what": f"graphopt optimize, llama-{a.layers}", "when": when, **r,
                         "optimize_steps": r["optimize_s"] / r["eager_step_s"],
                         "first_step_steps": r["first_step_s"] / r["eager_step_s"]})
            print(rows[-1], flush=True)
        if a.plan_layers:
            for when in ("cold", "warm"):
                r = in_process("plan", a.plan_layers, a.plan_width, os.path.join(cache, "plan"))
                rows.append({"what": f"graphopt.plan, llama {a.plan_layers} x {a.plan_width}", "when": when, **r})
                print(rows[-1], flush=True)
        if a.compile_layers:
            for when in ("cold", "warm"):
                r = in_process("compile", a.compile_layers, os.path.join(cache, "inductor"))
                rows.append({"what": f"torch.compile, llama-{a.compile_layers}", "when": when, **r,
                             "first_step_steps": r["first_step_s"] / r["eager_step_s"]})
                print(rows[-1], flush=True)
            if a.compile_layers != a.layers:  # graphopt at the depth torch.compile ran, for the same-model ratio
                for when in ("cold", "warm"):
                    r = in_process("graphopt", a.compile_layers, a.budget_fraction,
                                   os.path.join(cache, "graphopt-small"))
                    rows.append({"what": f"graphopt optimize, llama-{a.compile_layers}", "when": when, **r,
                                 "optimize_steps": r["optimize_s"] / r["eager_step_s"],
                                 "first_step_steps": r["first_step_s"] / r["eager_step_s"]})
                    print(rows[-1], flush=True)
    table = ["| start | when | eager step | plan or compile | first step done | in eager steps | plan cache |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        eager = f"{r['eager_step_s']:.3f} s" if "eager_step_s" in r else ""
        made = f"{r.get('optimize_s', r.get('plan_s', 0)):.2f} s" if "first_step_s" not in r or "optimize_s" in r \
            else ""
        first = f"{r['first_step_s']:.2f} s" if "first_step_s" in r else ""
        steps = f"{r['first_step_steps']:.1f}" if "first_step_steps" in r else ""
        table.append(f"| {r['what']} | {r['when']} | {eager} | {made} | {first} | {steps} | "
                     f"{r.get('plan_cache') or ''} |")
    print("\n".join(table))
    if a.out:
        write_results("warm_start", {"device": device_name(), "date": today(), "rows": rows},
                      f"# Warm start (bench/warm_start.py)\n\n{device_name()}, {today()}\n\n" + "\n".join(table) + "\n",
                      a.out)


if __name__ == "__main__":
    main()
