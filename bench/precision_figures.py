"""The precision pass's figures: a GPT training step in float32, graphopt bf16 and torch.autocast
bf16, measured in one run.

Shared by bench/test_bench_precision.py (pytest-benchmark, CI's quick mode) and
bench/gpu_precision.py (the whole measurement in one call, for a GPU machine). A step is
forward, loss and backward; the three variants share one model and its parameters.
"""
from __future__ import annotations

import time

import torch

import graphopt
from graphopt.analysis.memory import measure_step
from graphopt.testing import zoo

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# zoo.gpt arguments: on a GPU, large enough that matmuls (where bf16 pays) take the time;
# on a 2-core CPU, small enough for `make test`'s quick run.
SIZES = {
    "cpu": {"batch": 4, "seq": 64, "layers": 2, "dim": 128, "heads": 4, "vocab": 512},
    "quick": {"batch": 2, "seq": 32, "layers": 2, "dim": 64, "heads": 4, "vocab": 256},
    "cuda": {"batch": 16, "seq": 512, "layers": 8, "dim": 768, "heads": 12, "vocab": 8192},
}
VARIANTS = ("float32", "graphopt_bf16", "autocast_bf16")


class Autocast(torch.nn.Module):
    """The model under torch.autocast(dtype=bf16): the baseline graphopt's bf16 is held to."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            return self.model(*args, **kwargs)


def build(size: str):
    torch.manual_seed(0)
    model, args, kwargs = zoo.gpt(**SIZES[size])
    move = lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return model.to(DEVICE), tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def variants(model, args, kwargs) -> dict:
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, precision="bf16")
    return {"float32": model, "graphopt_bf16": opt, "autocast_bf16": Autocast(model)}


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def step_seconds(module, args, kwargs, n: int) -> float:
    """Median time of n training steps (after two warm-ups)."""
    times = []
    for k in range(n + 2):
        _sync()
        start = time.perf_counter()
        module(*args, **kwargs).loss.backward()
        _sync()
        if k >= 2:
            times.append(time.perf_counter() - start)
        for p in module.parameters():
            p.grad = None
    return sorted(times)[len(times) // 2]


def precision_run(size: str, steps: int, memory: bool = True) -> dict:
    """Step time (and measured peak) of each variant, and the ratios the pass is judged by:
    speedup over float32 (goal on a GPU: >= 1.8) and time relative to autocast (goal <= 1.05)."""
    model, args, kwargs = build(size)
    modules = variants(model, args, kwargs)
    stats = next(r.stats for r in modules["graphopt_bf16"].graphopt_report.passes if r.name.startswith("precision"))
    # interleaved rounds, so that a slow spell of the machine hits every variant alike
    seconds = {name: [] for name in VARIANTS}
    for _ in range(3):
        for name in VARIANTS:
            seconds[name].append(step_seconds(modules[name], args, kwargs, steps))
    best = {name: min(s) for name, s in seconds.items()}
    torch.manual_seed(0)
    losses = {name: float(modules[name](*args, **kwargs).loss.detach()) for name in VARIANTS}
    row = {
        "device": DEVICE, "size": size,
        **{f"{name}_ms": round(best[name] * 1e3, 2) for name in VARIANTS},
        "graphopt_speedup_vs_float32": round(best["float32"] / best["graphopt_bf16"], 3),
        "autocast_speedup_vs_float32": round(best["float32"] / best["autocast_bf16"], 3),
        "graphopt_time_vs_autocast": round(best["graphopt_bf16"] / best["autocast_bf16"], 3),
        "loss_rel_diff_vs_autocast": round(abs(losses["graphopt_bf16"] - losses["autocast_bf16"])
                                           / abs(losses["autocast_bf16"]), 4),
        "casts_inserted": stats["casts_inserted"], "ops_by_dtype": stats["ops_by_dtype"],
        "estimated_bytes_saved": stats["bytes_saved"],
    }
    if memory:
        peaks = {name: measure_step(modules[name], args, kwargs) for name in VARIANTS}
        row.update({f"{name}_peak_mb": round(peaks[name] / 1e6, 2) for name in VARIANTS})
    return row
