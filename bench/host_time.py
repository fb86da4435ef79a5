"""Python time per call of graphopt's fused ops, kernels left out: what a call costs the host
whatever the device (on a GPU, small tensors wait on it).

    python bench/host_time.py [--calls 300]

Cases: gpu_rows.py's RMSNorm (a row kernel) forward+backward, and gpu_fuse.py's two-op chain
forward and forward+backward, each optimized with passes="fuse" on CPU tensors under Triton's interpreter, its launches
replaced by no-ops; beside them, the call guard alone. Prints microseconds per call (best of 3).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402

import gpu_fuse  # noqa: E402
import gpu_rows  # noqa: E402
from graphopt.runtime.launch import no_kernel_launches  # noqa: E402


def _per_call(fn, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    calls = parser.parse_args(argv).calls
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    module, inputs, _ = gpu_rows.case("rms_norm", gpu_rows.CPU_SIZES["rms_norm"][0], cpu)
    rows = gpu_rows.run_step(gpu_fuse.graphopt.optimize(module, inputs, passes="fuse", train=True), inputs, True,
                             list(module.parameters()))
    x, b, g = gpu_fuse.make_inputs(4096, torch.float32, cpu, True)
    chain = gpu_fuse.fuse(gpu_fuse.Chain(2), x, b)
    chain_step = gpu_fuse.runner(chain, x, b, g, True)
    guard = next(iter(chain._forward_pre_hooks.values()))
    with no_kernel_launches():
        figures = {"RMSNorm forward+backward (row kernel)": _per_call(rows, calls),
                   "two-op chain forward (elementwise kernel)": _per_call(lambda: chain(x, b), calls),
                   "two-op chain forward+backward": _per_call(chain_step, calls),
                   "its call guard alone": _per_call(lambda: guard(chain, (x, b), {}), calls)}
    for what, us in figures.items():
        print(f"{what}: {us:.1f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
