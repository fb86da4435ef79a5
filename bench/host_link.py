"""The rates the host step is priced by (analysis/cost.py's host_bytes_per_s,
host_step_bytes_per_s and host_add_bytes_per_s), measured on this machine:

    python bench/host_link.py [--mb 256] [--out FILE]

host link: copies of a `--mb` MB buffer between device and host memory, each way (pinned host
memory and non_blocking copies on CUDA, as runtime/host_optimizer.py makes them; on CPU a copy
between two host buffers, the host's own memcpy). host step: torch.optim.AdamW's step on the host
over 16M float32 parameters and over 16M bfloat16 ones, per byte of the parameters it updates,
with its fused CPU kernel (what the host step runs where the user chose no implementation) and
with torch's default loop. host add: a microbatch's gradient added to what the host holds, over 16M
float32 and bfloat16 elements, per byte of the gradient (runtime/host_optimizer.py's accumulation).
The median of five runs each. Writes a markdown table (default
bench/results/host_link-<device>-<date>.md).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch


def timed(fn, sync, runs: int = 5) -> float:
    fn()
    sync()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--out")
    a = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = a.mb * 2**20
    on_device = torch.ones(n, dtype=torch.uint8, device=device)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    down = timed(lambda: host.copy_(on_device, non_blocking=cuda), sync)
    up = timed(lambda: on_device.copy_(host, non_blocking=cuda), sync)
    rows = [("host link, device to host", n, down), ("host link, host to device", n, up)]
    for fused in (True, None):
        for dtype in (torch.float32, torch.bfloat16):
            p = torch.nn.Parameter(torch.randn(16 * 2**20, dtype=dtype))
            p.grad = torch.randn_like(p)
            optimizer = torch.optim.AdamW([p], fused=fused)
            kernel = "fused" if fused else "default loop"
            rows.append((f"host AdamW step ({kernel}), {str(dtype).removeprefix('torch.')}",
                         p.untyped_storage().nbytes(), timed(optimizer.step, lambda: None)))
    for dtype in (torch.float32, torch.bfloat16):
        held, added = torch.randn(16 * 2**20, dtype=dtype), torch.randn(16 * 2**20, dtype=dtype)
        rows.append((f"host add of a gradient, {str(dtype).removeprefix('torch.')}", added.nbytes,
                     timed(lambda: held.add_(added), lambda: None)))
    name = torch.cuda.get_device_name() if cuda else "cpu"
    lines = [f"# The host step's rates on {name}, {datetime.date.today()}", "",
             f"`python bench/host_link.py --mb {a.mb}`; the median of five runs.", "",
             "| what | bytes | seconds | GB/s |", "|---|---:|---:|---:|"]
    lines += [f"| {what} | {nbytes} | {s:.4f} | {nbytes / s / 1e9:.2f} |" for what, nbytes, s in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out or Path(__file__).parent / "results" / f"host_link-{device}-{datetime.date.today()}.md")
    out.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
