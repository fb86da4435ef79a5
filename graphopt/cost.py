"""What recomputing a node costs: FLOPs from the registry, or its measured time (profile=True).

node_times runs the graph's forward on the example inputs (real tensors, the model's own
parameters), timing each call node by itself; the median of a few runs. Buffers and the RNG
are restored afterwards, so profiling leaves no trace on the model (batch-norm statistics,
dropout's random stream).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.fx

from . import ops
from .purity import CALLS
from .verify import trial_run


class _Timer(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, cuda: bool):
        super().__init__(gm)
        self.cuda = cuda
        self.times: dict[str, list[float]] = {}

    def run_node(self, n: torch.fx.Node):
        if n.op not in CALLS:
            return super().run_node(n)
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = super().run_node(n)
        if self.cuda:
            torch.cuda.synchronize()
        self.times.setdefault(n.name, []).append(time.perf_counter() - start)
        return out


def node_times(gm: torch.fx.GraphModule, flat_inputs: list, repeats: int = 3) -> dict[str, float]:
    """Median seconds of each call node's forward on the example inputs (after one warm-up run)."""
    cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in flat_inputs)
    timer = _Timer(gm, cuda)
    with trial_run(gm, flat_inputs), torch.no_grad():
        for _ in range(repeats + 1):
            timer.run(*flat_inputs)
    return {name: statistics.median(t[1:]) for name, t in timer.times.items()}


def recompute_costs(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], flat_inputs: list | None = None) -> list[int]:
    """Per node: FLOPs (ops.flops), or with flat_inputs its measured forward time in nanoseconds."""
    if flat_inputs is None:
        return [ops.flops(n, gm) if n.op in CALLS else 0 for n in nodes]
    times = node_times(gm, flat_inputs)
    return [round(times.get(n.name, 0.0) * 1e9) for n in nodes]
