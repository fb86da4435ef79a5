"""Fusion on the real-model corpus: kernels, the share of memory-bound ops left outside them, their
traffic before and after, and the training step's measured peak without and with fusion.

    TRITON_INTERPRET=1 python bench/fusion_coverage.py [--models a,b] [--out FILE]

Per model (tests/corpus, its own batch): passes="normalize,cse,dce,fuse" against
"normalize,cse,dce". Memory-bound ops are the forward's elementwise ops, casts, reductions,
norms, softmaxes, losses and dropouts (passes/fuse/fusion.memory_bound), after normalize (which
spells out torchvision's stochastic depth); the fuse pass's report counts them before and
after, with the bytes they read and write. The peaks are the user's step (forward, the case's
loss, backward, gradients None before), measured as live tensor storages with the kernels run
in Triton's interpreter.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def step_peak(module, case) -> int:
    from graphopt.analysis.live_storage import LiveStorage
    from graphopt.runtime.step import clear_grads

    clear_grads(case.model)
    resident = [*case.model.parameters(), *case.model.buffers(),
                *(t for t in torch.utils._pytree.tree_leaves((case.args, case.kwargs)) if isinstance(t, torch.Tensor))]
    torch.manual_seed(0)
    with LiveStorage(resident) as live:
        case.loss(module(*case.args, **case.kwargs)).backward()
    clear_grads(case.model)
    return live.peak


def measure(name: str) -> dict:
    import graphopt
    from corpus import CORPUS

    case = CORPUS[name].build()
    plain = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes="normalize,cse,dce")
    start = time.perf_counter()
    fused = graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, passes="normalize,cse,dce,fuse")
    seconds = time.perf_counter() - start
    stats = fused.graphopt_report.passes[-1].stats
    return {"model": name, "library": CORPUS[name].library, "kernels": stats["kernels"],
            "row_kernels": sum(g["rows"] for g in stats["groups"]),
            "bound": stats["memory_bound_ops"], "unfused": stats["memory_bound_ops_unfused"],
            "traffic_before": stats["memory_bound_traffic_before"], "traffic_after": stats["memory_bound_traffic_after"],
            "heads": len(stats["chunked_heads"]),
            "peak_plain": step_peak(plain, case), "peak_fused": step_peak(fused, case), "optimize_s": seconds}


def table(rows: list[dict]) -> str:
    from graphopt.analysis.memory import size_text

    lines = [f"# Fusion on the real-model corpus (CPU, kernels in Triton's interpreter)", "",
             f"Generated {datetime.date.today()} by `TRITON_INTERPRET=1 python bench/fusion_coverage.py` on "
             f"{platform.machine()} with torch {torch.__version__}. Memory-bound ops: the forward's elementwise "
             "ops, casts, reductions, norms, softmaxes, losses and dropouts; unfused: those left outside "
             "kernels. Traffic: the bytes they read and write, kernels counted by their inputs and outputs. "
             "Peaks: the user's step, measured. Head: the LM head and its cross-entropy run over chunks of rows "
             "(the group's traffic is counted as if its logits were read whole).", "",
             "| model | kernels (row) | head | memory-bound ops | unfused | share unfused | traffic before | traffic after "
             "| step peak plain | step peak fused | fused / plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['kernels']} ({r['row_kernels']}) | {'chunked' if r['heads'] else '-'} | "
                     f"{r['bound']} | {r['unfused']} | "
                     f"{r['unfused'] / max(r['bound'], 1):.0%} | {size_text(r['traffic_before'])} | "
                     f"{size_text(r['traffic_after'])} | {size_text(r['peak_plain'])} | {size_text(r['peak_fused'])} | "
                     f"{r['peak_fused'] / r['peak_plain']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from corpus import CORPUS

    if os.environ.get("TRITON_INTERPRET") != "1":
        print("run it with TRITON_INTERPRET=1: on CPU, fuse runs its kernels in Triton's interpreter")
        return 2
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CORPUS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        rows.append(measure(name))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = table(rows)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
