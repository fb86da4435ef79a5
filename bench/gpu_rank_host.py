"""A rank's shards on the host on a real device (the recompute pass's step 11): one rank of FSDP2 per
block, a Llama (transformers) planned with shard="fsdp" at 1.05 x the least budget graphopt names,
where the plan keeps the rank's sharded parameters, gradients and optimizer state on the host
(FSDP2's CPUOffloadPolicy, pinned on CUDA). Beside it, the same model as users shard it by hand:
FSDP2 with CPUOffloadPolicy, with and without its own checkpointing of every layer.

    python bench/gpu_rank_host.py [--layers 8] [--width 1024] [--tokens 2048] [--steps 5] [--out FILE]

One process, one rank (NCCL on CUDA, gloo on CPU). Per row: the predicted device part of the
rank's step, the measured one (torch.cuda.max_memory_allocated over a step after the first on CUDA;
on CPU torch's FSDPMemTracker less the host's categories), the median step time, and the loss of
each step against eager FSDP2 with CPUOffloadPolicy (bit for bit, or the largest difference).
Writes a markdown table (default bench/results/gpu_rank_host-<device>-<date>.md).
"""
from __future__ import annotations

import copy
import functools
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]  # graphopt from this checkout

import graphopt  # noqa: E402
from gpu_host_step import llama, llama_arguments  # noqa: E402  (bench/, beside this script)
from results_files import device_name, today, write_table  # noqa: E402
from graphopt.passes.shard.rank_memory import step_peak  # noqa: E402
from graphopt.runtime.fsdp import fully_shard_units, state_on_host  # noqa: E402

GB = 1e9


def by_hand(model, mesh, cuda: bool, own_checkpointing: bool):
    """model sharded as users shard it: each layer, then the root, with CPUOffloadPolicy."""
    layers = list(model.model.layers)
    if own_checkpointing:
        for layer in layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    policy = CPUOffloadPolicy(pin_memory=cuda)
    for k, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, reshard_after_forward=k < len(layers) - 1, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model


def measured(module, args, kwargs, steps: int, cuda: bool) -> tuple[int, float, list[float]]:
    """(the device's peak over a step after the first, median seconds of a step, each step's loss)."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    losses, times = [], []

    def step():
        loss = module(*args, **kwargs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    step()  # the optimizer's state exists from here on
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = step_peak(module, optimizer, args, kwargs, run=lambda: module(*args, **kwargs).loss.backward(),
                         host=True)["Total"]
        losses.append(float("nan"))  # step_peak's steps are its own: the loss lists stay aligned by index
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return peak, statistics.median(times), losses


def main() -> int:
    a = llama_arguments(__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    model, args, kwargs = llama(a.layers, a.width, a.tokens, device, torch.bfloat16 if cuda else torch.float32)
    rows = []
    reference = None
    for own in (False, True):
        peak, seconds, losses = measured(by_hand(copy.deepcopy(model), mesh, cuda, own), args, kwargs, a.steps, cuda)
        reference = reference or losses
        rows.append((f"FSDP2 + CPUOffloadPolicy{' + own checkpointing' if own else ''}", None, None, peak, seconds,
                     losses))

    def build(budget_gb):
        return graphopt.optimize(copy.deepcopy(model), args, kwargs, shard="fsdp", world_size=1, optimizer="adamw",
                                 budget_gb=budget_gb, plan_cache=False)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", graphopt.BudgetWarning)
        try:
            build(1e-6)
            raise AssertionError("a rank's step that fits in 1 kB")
        except graphopt.BudgetError as e:
            least = e.min_budget_bytes
        opt = build(least * 1.05 / GB)
    stats = opt.graphopt_report.passes[-1].stats
    on_host = state_on_host(opt)
    fully_shard_units(opt, mesh=mesh)
    peak, seconds, losses = measured(opt, args, kwargs, a.steps, cuda)
    slack = stats["rank_collective_slack_bytes"]  # what a collective may hold beyond the prediction
    rows.append((f"graphopt at 1.05 x its least ({'shards on the host' if on_host else 'shards on the device'}; "
                 f"slack {slack / GB:.3f} GB)", least * 1.05, stats["rank_peak_bytes"], peak, seconds, losses))
    dist.destroy_process_group()

    params = sum(p.numel() for p in model.parameters())
    lines = [f"# A rank's shards on the host, {device_name()}, {today()}", "",
             f"`python bench/gpu_rank_host.py --layers {a.layers} --width {a.width} --tokens {a.tokens} --steps "
             f"{a.steps}`: one FSDP2 rank, a Llama of {params / 1e6:.0f}M parameters, AdamW, 1 x {a.tokens} tokens. "
             "Device peak: " + ("torch.cuda.max_memory_allocated" if cuda else "FSDPMemTracker less the host's")
             + " over a step after the first; time: the median step; losses against the first row's.", "",
             "| run | budget | predicted device peak | measured | measured / predicted | step time | against the "
             "first | losses |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    base = rows[0][4]
    for what, budget, predicted, peak, seconds, losses in rows:
        diff = max(abs(x - y) for x, y in zip(losses, reference) if x == x and y == y)
        lines.append(f"| {what} | {f'{budget / GB:.3f} GB' if budget else '-'} | "
                     f"{f'{predicted / GB:.3f} GB' if predicted else '-'} | {peak / GB:.3f} GB | "
                     f"{f'{peak / predicted:.4f}' if predicted else '-'} | {seconds * 1e3:.1f} ms | "
                     f"{seconds / base:.2f} | {'equal' if diff == 0 else f'largest difference {diff:.3g}'} |")
    write_table("gpu_rank_host", "\n".join(lines) + "\n", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
