"""Step time with and without graphopt.prefetch on an input-heavy step: a small convnet on image
batches that come from host memory through a DataLoader (pin_memory on CUDA).

    python bench/gpu_prefetch.py [--steps 40] [--batch 64] [--size 160] [--out FILE]

without: each batch copied with .to(device, non_blocking=True) at the top of the step, as most loops
do; with: graphopt.prefetch(loader, device, depth=2), the copies on a side stream two batches
ahead. Both loops in the same process, in turns, the median step time of each (after two warm-up
steps). On CPU there is nothing to overlap: the two are the same loop, a check that it runs.
Writes a markdown table (default bench/results/gpu_prefetch-<device>-<date>.md).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]  # graphopt from this checkout

import graphopt  # noqa: E402
from results_files import device_name, today, write_table  # noqa: E402  (bench/, beside this script)


def convnet(classes: int = 10) -> torch.nn.Module:
    c = torch.nn.Conv2d
    return torch.nn.Sequential(c(3, 32, 3, stride=2, padding=1), torch.nn.ReLU(), c(32, 64, 3, stride=2, padding=1),
                               torch.nn.ReLU(), c(64, 64, 3, stride=2, padding=1), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, classes))


def epoch_times(batches, model, optimizer, device, sync) -> list[float]:
    times = []
    start = time.perf_counter()
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)  # a no-op when prefetched
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sync()
        now = time.perf_counter()
        times.append(now - start)
        start = now
    return times[2:]  # the first steps warm up


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=160)
    parser.add_argument("--out")
    a = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    images = torch.randn(a.steps * a.batch, 3, a.size, a.size)
    labels = torch.randint(0, 10, (a.steps * a.batch,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=a.batch,
                                         pin_memory=cuda)
    model = convnet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    runs = {"without": [], "with prefetch (depth 2)": []}
    for _ in range(3):  # in turns: the machine's drift falls on both
        runs["without"] += epoch_times(loader, model, optimizer, device, sync)
        runs["with prefetch (depth 2)"] += epoch_times(graphopt.prefetch(loader, device, depth=2), model, optimizer,
                                                       device, sync)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    batch_mb = (images[0].numel() * images.element_size() * a.batch) / 1e6
    name = device_name()
    base = medians["without"]
    lines = [f"# graphopt.prefetch on {name}, {today()}", "",
             f"`python bench/gpu_prefetch.py --steps {a.steps} --batch {a.batch} --size {a.size}`: a convnet's SGD "
             f"step on {a.batch} x 3 x {a.size} x {a.size} float32 images ({batch_mb:.1f} MB a batch) from a "
             f"DataLoader{' with pin_memory' if cuda else ''}; median step time over three passes each, in turns.", "",
             "| loop | median step | against without |", "|---|---:|---:|"]
    lines += [f"| {k} | {v * 1e3:.3f} ms | {v / base:.3f} |" for k, v in medians.items()]
    write_table("gpu_prefetch", "\n".join(lines) + "\n", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
