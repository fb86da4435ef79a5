"""Where a CUDA step's measured peak departs from graphopt's estimate: for each zoo model at its GPU
size, the traced graph's estimate and measured peak, the same with cuDNN's autotuning off and with
SDPA's math backend, and the allocator's snapshot of the step (torch.cuda.memory._dump_snapshot)
for reading offline (torch's memory_viz, or bench/memory_snapshot_read.py).

    python bench/gpu_memory_gap.py --out DIR [--models gpt,convnet]
"""
from __future__ import annotations

import argparse
import gzip
import json
import pickle
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402

import graphopt  # noqa: E402
import recompute_figures as rf  # noqa: E402
from graphopt.analysis.memory import measure_step  # noqa: E402


def gap(name: str, out: Path) -> dict:
    model, args, kwargs = rf.build(name)
    gm = graphopt.trace(model, args, kwargs)
    estimate = rf._estimate(gm, args, kwargs)
    row = {"model": name, "estimate_mb": round(estimate.peak_bytes / 1e6, 1),
           "measured_mb": round(measure_step(gm, args, kwargs) / 1e6, 1)}
    torch.backends.cudnn.benchmark = False
    with torch.backends.cudnn.flags(enabled=False):
        row["measured_no_cudnn_mb"] = round(measure_step(gm, args, kwargs) / 1e6, 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        row["measured_sdpa_math_mb"] = round(measure_step(gm, args, kwargs) / 1e6, 1)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    measure_step(gm, args, kwargs)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with gzip.open(out / f"snapshot-{name}.pickle.gz", "wb") as f:
        pickle.dump(snapshot, f)
    row["allocated_before_mb"] = round(before / 1e6, 1)
    row["nodes"] = len(gm.graph.nodes)
    (out / f"graph-{name}.txt").write_text(gm.code)
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="gpt,convnet,mlp")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        try:
            rows.append(gap(name, out))
        except Exception as error:  # the next model's figures still count
            rows.append({"model": name, "error": f"{type(error).__name__}: {error}"})
            print(rows[-1], flush=True)
    (out / "memory_gap.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
