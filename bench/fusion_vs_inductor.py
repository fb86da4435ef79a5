"""graphopt's fuse pass against torch.compile (Inductor) on real-model corpus models: forward
kernels, bytes they access, and the time to a first optimized training step.

    TRITON_INTERPRET=1 python bench/fusion_vs_inductor.py [--models a,b] [--out FILE.md]
        [--inductor-from FILE.json]   # Inductor's side from an earlier run, graphopt's measured again

Per model (tests/corpus, its own batch), each in a process of its own with fresh compiler caches:
  - graphopt: passes="normalize,cse,dce,fuse"; forward kernels for memory-bound work = its fused
    kernels plus the memory-bound ops left outside them (each one eager kernel); bytes = the
    report's memory-bound traffic after fusion; setup = optimize()'s wall time (tracing,
    analyses, kernel sources; kernels compile on first launch: on CPU they run in Triton's
    interpreter, which compiles nothing).
  - Inductor: torch.compile(model) with the case's loss, one forward (the forward graph's kernels
    and torch._inductor.metrics.num_bytes_accessed, matmuls and convolutions excluded as extern
    kernels; Inductor counts bytes for its Triton kernels only: "-" on CPU); setup = the first
    forward and backward's wall time less an eager step's.
On a GPU run it the same way without TRITON_INTERPRET for Triton kernels on both sides.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def graphopt_side(case) -> dict:
    import graphopt

    start = time.perf_counter()
    opt = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes="normalize,cse,dce,fuse")
    seconds = time.perf_counter() - start
    stats = opt.graphopt_report.passes[-1].stats
    return {"graphopt_kernels": stats["kernels"] + stats["memory_bound_ops_unfused"],
            "graphopt_bytes": stats["memory_bound_traffic_after"], "graphopt_setup_s": seconds}


def inductor_side(case) -> dict:
    from torch._inductor import metrics

    from graphopt.runtime.step import clear_grads

    torch._dynamo.reset()
    metrics.reset()
    compiled = torch.compile(case.model)

    def step(module):
        clear_grads(case.model)
        case.loss(module(*case.args, **case.kwargs)).backward()
        clear_grads(case.model)

    start = time.perf_counter()
    loss = case.loss(compiled(*case.args, **case.kwargs))
    kernels, accessed = metrics.generated_kernel_count, metrics.num_bytes_accessed
    loss.backward()
    step_kernels = metrics.generated_kernel_count
    clear_grads(case.model)
    first = time.perf_counter() - start
    step(case.model)
    start = time.perf_counter()
    step(case.model)
    eager = time.perf_counter() - start
    return {"inductor_kernels": kernels, "inductor_step_kernels": step_kernels, "inductor_bytes": accessed,
            "inductor_setup_s": first - eager}


def table(rows: list[dict], inductor_from: str | None = None) -> str:
    from graphopt.analysis.memory import size_text

    earlier = f" Inductor's columns come from {os.path.basename(inductor_from)}, an earlier run; graphopt's " \
              "were measured in this one." if inductor_from else ""

    lines = ["# graphopt's fuse pass against torch.compile (Inductor) on the real-model corpus", "",
             f"Generated {datetime.date.today()} by `{'TRITON_INTERPRET=1 ' if os.environ.get('TRITON_INTERPRET') == '1' else ''}"
             f"python bench/fusion_vs_inductor.py` on {platform.machine()} with "
             f"torch {torch.__version__} ({'CUDA' if torch.cuda.is_available() else 'CPU: Inductor writes C++'}). "
             "Forward kernels: graphopt's fused kernels plus the memory-bound ops left outside them, against "
             "every kernel Inductor generates for the forward; bytes those access; setup: graphopt's optimize() "
             f"against Inductor's first training step less an eager step.{earlier}", "",
             "| model | forward kernels: graphopt / Inductor | Inductor's whole step | bytes: graphopt / Inductor | "
             "setup s: graphopt / Inductor | setup ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['graphopt_kernels']} / {r['inductor_kernels']} | {r['inductor_step_kernels']} | "
                     f"{size_text(r['graphopt_bytes'])} / "
                     f"{size_text(int(r['inductor_bytes'])) if r['inductor_bytes'] else '-'} | "
                     f"{r['graphopt_setup_s']:.2f} / {r['inductor_setup_s']:.2f} | "
                     f"{r['graphopt_setup_s'] / max(r['inductor_setup_s'], 1e-9):.2f} |")
    return "\n".join(lines) + "\n"


def measure(name: str, sides: str) -> dict:
    from corpus import CORPUS

    case = CORPUS[name].build()
    row = {"model": name}
    if "graphopt" in sides:
        row.update(graphopt_side(case))
    if "inductor" in sides:
        row.update(inductor_side(case))
    return row


def measured_apart(name: str, sides: str) -> dict:
    """One model in a fresh process with fresh compiler caches: Inductor compiles it for real,
    not from the caches an earlier model of the same shape filled."""
    with tempfile.TemporaryDirectory(prefix="graphopt-inductor-") as cache:
        done = subprocess.run([sys.executable, __file__, "--one", name, "--sides", sides], capture_output=True,
                              text=True, check=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="hf_llama,hf_gpt2,hf_bert,timm_resnet18,timm_efficientnet_b0")
    parser.add_argument("--out", default=None)
    parser.add_argument("--inductor-from", default=None,
                        help="a JSON file an earlier run wrote: take Inductor's side from it, measure graphopt's again")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # measure one model, print its row as JSON
    parser.add_argument("--sides", default="graphopt,inductor", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.sides)))
        return 0
    earlier = {}
    if args.inductor_from:
        with open(args.inductor_from) as f:
            earlier = {r["model"]: r for r in json.load(f)}
    rows = []
    for name in args.models.split(","):
        if name in earlier:
            row = {**earlier[name], **measured_apart(name, "graphopt")}
        else:
            row = measured_apart(name, "graphopt,inductor")
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table(rows, args.inductor_from))
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
