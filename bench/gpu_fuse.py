"""The fuse pass on elementwise chains: eager vs graphopt vs torch.compile, in one run, one command.

    python bench/gpu_fuse.py                 # on a GPU: the full matrix
    python bench/gpu_fuse.py --out DIR       # where the results go (default $OUT, else bench/results)

Chains of 2, 4 and 8 elementwise ops (bias add, GELU, scale, SiLU, shift, tanh, gate, sigmoid) on
2^20 .. 2^26 elements, float32 and bfloat16, forward and forward+backward. Each is timed for eager,
graphopt (the fuse pass on the traced chain) and torch.compile (default mode), next to a
device-to-device copy of the input measured in the same run: achieved bandwidth is reported as a
fraction of the copy's, counting the bytes an ideal fused kernel moves (forward: read x, write y;
backward: read x and dy, write dx; the bias is small). First call: with fresh on-disk caches for
Triton and Inductor, and each tool warmed up once on another function (imports, worker pools), the
time from graphopt's optimize() to its first finished training step against torch.compile's.

Without CUDA it runs a reduced CPU mode (small sizes, no torch.compile; graphopt's kernels run in
Triton's interpreter, where fuse leaves groups alone otherwise) so the script itself can be checked
anywhere. Writes fuse-<device>-<date>.json and .md.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    # fresh compiler caches, so first calls compile for real: set before torch and triton read them
    _cache = tempfile.mkdtemp(prefix="graphopt-bench-")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_cache, "triton"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_cache, "inductor"))
    os.environ.setdefault("GRAPHOPT_KERNEL_DIR", os.path.join(_cache, "graphopt"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

import graphopt
from graphopt import runtime
from results_files import device_name, today, write_results

# each step maps (h, x, b) -> h; a chain of length k runs the first k
STEPS = (
    ("bias", lambda h, x, b: h + b),
    ("gelu", lambda h, x, b: F.gelu(h)),
    ("scale", lambda h, x, b: h * 1.5),
    ("silu", lambda h, x, b: F.silu(h)),
    ("shift", lambda h, x, b: h + 0.25),
    ("tanh", lambda h, x, b: torch.tanh(h)),
    ("gate", lambda h, x, b: h * x),
    ("sigmoid", lambda h, x, b: torch.sigmoid(h)),
)
LENGTHS = (2, 4, 8)
GPU_SIZES = tuple(2**e for e in (20, 22, 24, 26))
CPU_SIZES = (2**12, 2**14)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COLUMNS = 1024  # the bias is one row: x is (n / COLUMNS, COLUMNS)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class Chain(nn.Module):
    def __init__(self, length: int):
        super().__init__()
        self.length = length

    def forward(self, x, b):
        h = x
        for _, step in STEPS[:self.length]:
            h = step(h, x, b)
        return h


def describe(length: int) -> str:
    return " -> ".join(name for name, _ in STEPS[:length])


def make_inputs(n: int, dtype, device, backward: bool):
    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(n // COLUMNS, COLUMNS, device=device, generator=gen).to(dtype).requires_grad_(backward)
    b = torch.randn(COLUMNS, device=device, generator=gen).to(dtype).requires_grad_(backward)
    g = torch.randn(n // COLUMNS, COLUMNS, device=device, generator=gen).to(dtype)
    return x, b, g


def runner(module, x, b, g, backward: bool):
    if backward:
        return lambda: torch.autograd.grad(module(x, b), (x, b), g)
    return lambda: module(x, b)


def timer(device):
    """Seconds per call: Triton's do_bench (median, L2 flushed between runs) on CUDA, else the fastest of
    a few wall-clock rounds (a shared CPU's interference only ever adds time)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3

    def wall(fn, rounds=7):
        fn()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)
    return wall


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fuse(module, x, b) -> torch.nn.Module:
    opt = graphopt.optimize(module, (x, b), passes="fuse", train=True)
    kernels = opt.graphopt_report.passes[-1].stats["kernels"]
    if kernels != 1:
        raise RuntimeError(f"the fuse pass made {kernels} kernels of the chain {describe(module.length)}; expected 1")
    return opt


def max_error(got, want) -> float:
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    return max(float((a.float() - w.float()).abs().max() / (w.float().abs().max() + 1e-12)) for a, w in zip(got, want))


def measure(length: int, n: int, dtype, backward: bool, device, compiled=None, time_fn=None) -> dict:
    """One row: seconds per call for copy, eager, graphopt (and torch.compile), bandwidth fractions."""
    time_fn = time_fn or timer(device)
    module = Chain(length)
    x, b, g = make_inputs(n, dtype, device, backward)
    opt = fuse(module, x, b)
    eager_run, fused_run = runner(module, x, b, g, backward), runner(opt, x, b, g, backward)
    got, eager = fused_run(), eager_run()
    error, allowed = max_error(got, eager), TOLERANCE[dtype]
    if dtype != torch.float32:  # eager rounds after every op, the kernel once: both against float32
        wide = [t.detach().float().requires_grad_(backward) for t in (x, b)]
        want = runner(module, *wide, g.float(), backward)()
        error, allowed = max_error(got, want), max(allowed, 2 * max_error(eager, want))
    if error > allowed:
        raise AssertionError(f"graphopt's {describe(length)} differs from eager by {error:.3g} (relative) at "
                             f"{n} elements, {dtype}")
    seconds = {"copy": time_fn(lambda: x.detach().clone()), "eager": time_fn(eager_run), "graphopt": time_fn(fused_run)}
    if compiled is not None:
        seconds["compile"] = time_fn(runner(compiled, x, b, g, backward))
    size = x.element_size() * n
    ideal = size * (5 if backward else 2)  # forward: x in, y out; backward: x and dy in, dx out
    copy_bandwidth = 2 * size / seconds["copy"]
    row = {"chain": length, "ops": describe(length), "elements": n, "dtype": str(dtype).replace("torch.", ""),
           "pass": "fwd+bwd" if backward else "fwd", "max_rel_error": error}
    for method, s in seconds.items():
        row[f"{method}_us"] = round(s * 1e6, 2)
        if method != "copy":
            row[f"{method}_of_copy_bw"] = round(ideal / s / copy_bandwidth, 3)
    if "compile" in seconds:
        row["graphopt_over_compile_time"] = round(seconds["graphopt"] / seconds["compile"], 3)
    row["graphopt_speedup_over_eager"] = round(seconds["eager"] / seconds["graphopt"], 2)
    return row


def first_call(length: int, device, with_compile: bool) -> dict:
    """Seconds from nothing to a finished first training step (kernels compiled on the way)."""
    module = Chain(length)
    x, b, g = make_inputs(2**20 if device.type == "cuda" else CPU_SIZES[0], torch.float32, device, True)
    runtime.clear_cache()
    sync(device)
    start = time.perf_counter()
    opt = fuse(module, x, b)
    runner(opt, x, b, g, True)()
    sync(device)
    row = {"chain": length, "graphopt_first_step_s": round(time.perf_counter() - start, 4)}
    if with_compile:
        torch._dynamo.reset()
        start = time.perf_counter()
        runner(torch.compile(module), x, b, g, True)()
        sync(device)
        row["compile_first_step_s"] = round(time.perf_counter() - start, 3)
        row["compile_over_graphopt"] = round(row["compile_first_step_s"] / row["graphopt_first_step_s"], 1)
    return row


def warm_up(device, with_compile: bool) -> None:
    """Each tool's one-time start-up (imports, FakeTensor machinery, Inductor's workers), on another function."""
    x = torch.randn(64, 8, device=device, requires_grad=True)
    module = nn.Sequential(nn.Tanh(), nn.Sigmoid())
    fuse_pass = graphopt.optimize(module, (x,), passes="fuse", train=True)
    torch.autograd.grad(fuse_pass(x).sum(), x)
    if with_compile:
        torch.autograd.grad(torch.compile(module)(x).sum(), x)
    runtime.clear_cache()
    torch._dynamo.reset()
    sync(device)


def run(sizes=None, lengths=LENGTHS, dtypes=tuple(DTYPES), device=None, with_compile=None, log=print,
        seconds=None) -> dict:
    """The first-call rows, then the matrix, largest size first; with `seconds`, no row starts after that many
    seconds (the rows measured by then are returned, and how many of the matrix's)."""
    deadline = None if seconds is None else time.perf_counter() + seconds
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with_compile = device.type == "cuda" if with_compile is None else with_compile
    sizes = sizes or (GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    warm_up(device, with_compile)
    first = []
    for length in lengths:  # before the chains' kernels exist
        if deadline is None or time.perf_counter() < deadline:
            try:
                first.append(first_call(length, device, with_compile))
            except Exception as error:
                first.append(failed_row(error, chain=length))
            log(first[-1])
    # the large sizes first: there kernels, not launches, take the time, and a run cut short has them
    matrix = [(n, length, backward, dtype) for n in sorted(sizes, reverse=True) for length in lengths
              for backward in (False, True) for dtype in dtypes]
    rows, time_fn, compiled = [], timer(device), {}
    # each (length, pass) compiles once per size and dtype; past dynamo's default limit (8) it would run eager
    for limit in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 4 * len(matrix))
    for n, length, backward, dtype in matrix:
        if deadline is not None and time.perf_counter() >= deadline:
            break
        if with_compile and (length, backward) not in compiled:
            compiled[length, backward] = torch.compile(Chain(length))
        try:
            row = measure(length, n, DTYPES[dtype], backward, device, compiled.get((length, backward)), time_fn)
        except Exception as error:  # one row's failure (a kernel that does not build, a wrong result) is a row too
            row = failed_row(error, chain=length, ops=describe(length), elements=n, dtype=dtype,
                             **{"pass": "fwd+bwd" if backward else "fwd"})
        log(row)
        rows.append(row)
    rows.sort(key=lambda r: (r["chain"], r["pass"], list(DTYPES).index(r["dtype"]), r["elements"]))
    profiles = []
    if "bfloat16" in dtypes and (deadline is None or time.perf_counter() < deadline):
        try:  # the bf16 2-op chain's forward+backward was slower than eager on the first H200 run
            profiles.append(profile(min(lengths), max(sizes), "bfloat16", device))
        except Exception as error:
            profiles.append(failed_row(error, chain=min(lengths), elements=max(sizes), dtype="bfloat16"))
    return {"device": device_name(), "date": today(), "torch": torch.__version__,
            "triton": _version("triton"), "mode": "gpu" if device.type == "cuda" else "cpu (reduced, no torch.compile)",
            "first_call": first, "rows": rows, "profiles": profiles, "planned_rows": len(matrix),
            "stopped": None if len(rows) == len(matrix) and len(first) == len(lengths)
            else f"the {seconds} s given ran out: {len(first)} of {len(lengths)} first calls, "
                 f"{len(rows)} of {len(matrix)} rows measured"}


def profile(length: int, n: int, dtype: str, device, calls: int = 5) -> dict:
    """Per-kernel device time of one forward+backward row for eager, graphopt and torch.compile
    (torch.profiler): which kernels a slow row spends its time in."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiling

    module = Chain(length)
    x, b, g = make_inputs(n, DTYPES[dtype], device, True)
    methods = {"eager": module, "graphopt": fuse(module, x, b)}
    if device.type == "cuda":
        methods["compile"] = torch.compile(Chain(length))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    tables = {}
    for method, m in methods.items():
        run_once = runner(m, x, b, g, True)
        run_once()
        sync(device)
        with profiling(activities=activities) as prof:
            for _ in range(calls):
                run_once()
            sync(device)
        tables[method] = prof.key_averages().table(sort_by=sort, row_limit=10, max_name_column_width=60)
    return {"chain": length, "elements": n, "dtype": dtype, "calls": calls, "tables": tables}


def failed_row(error: Exception, **row) -> dict:
    """A measurement that raised, kept in the table with its error: the run goes on, and exits non-zero."""
    return {**row, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"}


def failures(result: dict) -> int:
    return sum("error" in row for key in ("first_call", "rows", "profiles") for row in result.get(key, ()))


def _version(package: str) -> str:
    try:
        return __import__(package).__version__
    except ImportError:
        return "not installed"


def markdown(result: dict) -> str:
    lines = [f"# fuse benchmark: {result['device']}, {result['date']}", "",
             f"torch {result['torch']}, triton {result['triton']}, mode: {result['mode']}", ""]
    if result.get("stopped"):
        lines += [f"Stopped early: {result['stopped']}.", ""]
    lines += ["## first training step (seconds, from optimize() / torch.compile() to a finished backward)", ""]
    if result["first_call"]:
        lines += _table(list(dict.fromkeys(c for r in result["first_call"] for c in r)), result["first_call"])
    lines += ["", "## time per call and bandwidth as a fraction of a device copy", ""]
    if result["rows"]:
        cols = dict.fromkeys(c for r in result["rows"] for c in r if c not in ("ops", "max_rel_error", "error"))
        lines += _table([*cols, "error"] if failures(result) else list(cols), result["rows"])
    for p in result.get("profiles", ()):
        lines += ["", f"## where the time goes: chain {p['chain']}, {p['elements']} elements, {p['dtype']}, "
                      f"forward+backward, {p.get('calls', '')} calls", ""]
        if "error" in p:
            lines += [f"failed: {p['error']}"]
        for method, table in p.get("tables", {}).items():
            lines += [f"{method}:", "", "```", table.rstrip(), "```", ""]
    lines += ["", "chains: " + "; ".join(f"{k}: {describe(k)}" for k in LENGTHS)]
    return "\n".join(lines) + "\n"


def _table(cols, rows) -> list[str]:
    return (["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"),
                        help="directory for the JSON and markdown results (default: $OUT, else bench/results)")
    parser.add_argument("--sizes", help="comma-separated log2 element counts (default: 20,22,24,26 on GPU)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--seconds", type=float,
                        help="start no measurement after this many seconds; write what was measured")
    args = parser.parse_args(argv)
    sizes = tuple(2 ** int(e) for e in args.sizes.split(",")) if args.sizes else None
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # a shared CPU's idle worker threads stall small parallel ops by milliseconds
        os.environ["TRITON_INTERPRET"] = "1"
    result = run(sizes=sizes, with_compile=False if args.no_compile else None, seconds=args.seconds)
    for path in write_results("fuse", result, markdown(result), args.out):
        print(f"wrote {path}")
    return 1 if failures(result) else 0


if __name__ == "__main__":
    sys.exit(main())
