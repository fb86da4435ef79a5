"""The recompute pass's figures, each measured against its baselines in the same run.

Shared by bench/test_bench_recompute.py (pytest-benchmark, CI's quick mode) and
bench/gpu_recompute.py (the whole measurement in one call, for a GPU machine). Budgets are
parameters + gradients + f x the rest of the unoptimized step's estimated peak (budget_at).
"""
from __future__ import annotations

import random
import time

import torch

import graphopt
from graphopt import ops
from graphopt.analysis.memory import GB, estimate_peak, measure_step
from graphopt.passes.recompute.rewrite import checkpoint_segments
from graphopt.passes.recompute.solver import make_atoms, solve
from graphopt.testing import zoo
from graphopt.testing.baselines import budget_at
from graphopt.frontend.graph_inputs import placeholder_values
from least_budget import idle_budget_bytes, least_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# zoo builder arguments: small enough for a 2-core CPU; on a GPU, large enough that kernels,
# not launches, take the time.
MODELS = {
    "cpu": {
        "mlp": {"batch": 512, "width": 256, "depth": 8},
        "convnet": {"batch": 16, "size": 32, "blocks": 6},
        "gpt": {"batch": 8, "seq": 64, "layers": 4},
    },
    "cuda": {
        "mlp": {"batch": 8192, "width": 2048, "depth": 8},
        "convnet": {"batch": 64, "channels": 64, "size": 64, "blocks": 8},
        "gpt": {"batch": 16, "seq": 512, "layers": 8, "dim": 512, "heads": 8, "vocab": 8192},
    },
}
SIZES = MODELS["cuda" if DEVICE == "cuda" else "cpu"]


def build(name: str):
    torch.manual_seed(0)
    model, args, kwargs = getattr(zoo, name)(**SIZES[name])
    move = lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return model.to(DEVICE), tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def _estimate(module, args, kwargs):
    gm = module if isinstance(module, torch.fx.GraphModule) else graphopt.trace(module, args, kwargs)
    return estimate_peak(gm, placeholder_values(gm, args, kwargs))


def _loss(out):
    return out.loss if hasattr(out, "loss") and out.loss is not None else out.float().pow(2).mean()


def step_seconds(module, args, kwargs, n: int) -> float:
    """Median time of n training steps (after one warm-up)."""
    times = []
    for k in range(n + 1):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _loss(module(*args, **kwargs)).backward()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        if k:
            times.append(time.perf_counter() - start)
        for p in module.parameters():
            p.grad = None
    return sorted(times)[len(times) // 2]


def estimate_error(name: str) -> dict:
    model, args, kwargs = build(name)
    gm = graphopt.trace(model, args, kwargs)
    estimate = _estimate(gm, args, kwargs).peak_bytes
    measured = measure_step(gm, args, kwargs)
    return {"estimate_mb": round(estimate / 1e6, 2), "measured_mb": round(measured / 1e6, 2),
            "error_pct": round(100 * (estimate - measured) / measured, 1)}


def hand_checkpointed(model, args, kwargs):
    """The GPT with every block checkpointed by hand (torch.utils.checkpoint), and its FLOPs."""
    hand = graphopt.trace(model, args, kwargs)
    blocks = zoo.block_segments(hand)
    flops = sum(ops.flops(n, hand) for block in blocks for n in block)
    return checkpoint_segments(hand, blocks), flops


def budget_run(name: str, f: float, steps: int, span: str = "state") -> dict:
    """The pass at budget f: measured peak / budget, recompute share and step time against no
    recompute; for the GPT also against checkpointing every block by hand. span "state": f of the
    step's peak beyond parameters and gradients (budget_at); "least": f of the way from graphopt's
    least budget to the least at which it recomputes nothing (at GPU sizes the first puts every f
    below the least)."""
    model, args, kwargs = build(name)
    peak = _estimate(model, args, kwargs)
    if span == "least":
        least = least_bytes(model, args, kwargs)
        budget_gb = (least + f * (idle_budget_bytes(model, args, kwargs) - least)) / GB
    else:
        budget_gb = budget_at(peak, f)
    row = {"f": f, "span": span, "budget_mb": round(budget_gb * 1e3, 2)}
    try:
        opt = graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=budget_gb)
    except graphopt.BudgetError as err:
        return {**row, "result": "BudgetError", "min_budget_mb": round(err.min_budget_gb * 1e3, 2)}
    stats = opt.graphopt_report.recompute().stats  # fuse runs after it on a GPU
    plain = graphopt.trace(model, args, kwargs)
    base = step_seconds(plain, args, kwargs, steps)
    row.update(result="fits", measured_over_budget=round(measure_step(opt, args, kwargs) / (budget_gb * GB), 3),
               segments=stats["segments"], selective=stats.get("selective_segments", 0),
               recompute_pct=stats["recompute_overhead_pct"],
               step_time_vs_plain=round(step_seconds(opt, args, kwargs, steps) / base, 3))
    if name == "gpt":
        hand, hand_flops = hand_checkpointed(model, args, kwargs)
        row.update(hand_measured_over_budget=round(measure_step(hand, args, kwargs) / (budget_gb * GB), 3),
                   recompute_flops_over_hand=round(stats["recompute_flops"] / hand_flops, 3),
                   hand_step_time_vs_plain=round(step_seconds(hand, args, kwargs, steps) / base, 3))
    return row


def at_hand_memory(steps: int) -> dict:
    """The GPT with its budget set to what checkpointing every block by hand measures: the
    pass's recompute FLOPs, measured peak and step time against the hand-written plan's."""
    model, args, kwargs = build("gpt")
    hand, hand_flops = hand_checkpointed(model, args, kwargs)
    hand_peak = measure_step(hand, args, kwargs)
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, budget_gb=hand_peak / GB)
    stats = opt.graphopt_report.recompute().stats  # fuse runs after it on a GPU
    return {"hand_peak_mb": round(hand_peak / 1e6, 2),
            "measured_over_hand": round(measure_step(opt, args, kwargs) / hand_peak, 3),
            "recompute_flops_over_hand": round(stats.get("recompute_flops", 0) / hand_flops, 3),  # none: nothing recomputed
            "step_time_over_hand": round(step_seconds(opt, args, kwargs, steps) / step_seconds(hand, args, kwargs, steps), 3)}


def solver_time(nodes: int) -> float:
    """Seconds to make atoms and solve a random graph of `nodes` nodes at half its memory."""
    rng = random.Random(nodes)
    kept = [rng.randint(0, 1 << 20) for _ in range(nodes)]
    live = [rng.randint(1 << 18, 1 << 22) for _ in range(nodes)]
    cost = [rng.randint(1, 1 << 30) for _ in range(nodes)]
    ok = [rng.random() > 0.02 for _ in range(nodes)]
    keeps = [rng.random() < 0.2 for _ in range(nodes)]
    sel = [rng.randint(0, 1 << 20) if k else 0 for k in keeps]
    sel_cost = [c if k else 0 for c, k in zip(cost, keeps)]
    start = time.perf_counter()
    solve(make_atoms(kept, live, cost, ok, sel, sel_cost), sum(kept) // 2)
    return time.perf_counter() - start
