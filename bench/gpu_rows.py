"""The fuse pass on norms, softmaxes and cross-entropy: eager vs graphopt vs torch.compile (and
Liger-Kernel where it is installed), in one run, one command.

    python bench/gpu_rows.py                 # on a GPU: the full matrix
    python bench/gpu_rows.py --out DIR       # where the results go (default $OUT, else bench/results)

Cases, each a module graphopt fuses into one row kernel (checked: one kernel, equal to eager):
  rms_norm     transformers' RMSNorm (pow, mean, add, rsqrt, mul, mul weight) after a residual add
  layer_norm   residual add + nn.LayerNorm
  softmax      attention scores * scale + a causal mask broadcast over heads, softmax
  cross_entropy  F.cross_entropy over [tokens, vocab] logits (32k vocabulary)
  batch_norm   nn.BatchNorm2d in training + residual add + ReLU
  linear_cross_entropy  an LM head (nn.Linear, no bias) and F.cross_entropy over its logits: graphopt
               runs them over chunks of rows, the logits never whole (Liger-Kernel's fused linear
               cross-entropy beside it); its backward includes the head weight's gradient
on sizes from a small model's to a large one's, float32, forward and forward+backward (the gradients of the inputs
and of the module's parameters, as a training step forms them). Each is
timed for eager, graphopt and torch.compile (default mode), next to a device-to-device copy of
the main input in the same run: achieved bandwidth is reported as a fraction of the copy's,
counting the bytes an ideal fused kernel moves (forward: read x, write y; backward: read x and
dy, write dx). Liger-Kernel's RMSNorm, LayerNorm and cross-entropy are timed beside them when
`liger_kernel` imports. The peak memory of forward+backward (torch.cuda.max_memory_allocated) is
reported for each.

Without CUDA it runs a reduced CPU mode (small sizes, kernels in Triton's interpreter, no
torch.compile or Liger) so the script itself can be checked anywhere. Writes
rows-<device>-<date>.json and .md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

import graphopt
from gpu_fuse import _table, _version, failed_row, failures, max_error, sync, timer
from results_files import device_name, today, write_results


class RMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))

    def forward(self, x, residual):
        h = x + residual
        variance = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(variance + 1e-6))


class LayerNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)

    def forward(self, x, residual):
        return self.norm(x + residual)


class Softmax(nn.Module):
    def forward(self, scores, mask):
        return F.softmax(scores * 0.125 + mask, dim=-1)


class CrossEntropy(nn.Module):
    def forward(self, logits, target):
        return F.cross_entropy(logits, target)


class LinearCrossEntropy(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x, target):
        return F.cross_entropy(self.head(x), target)


class BatchNorm(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x, residual):
        return torch.relu(self.bn(x) + residual)


# (rows, width) per size: a small model's to a large one's
GPU_SIZES = {"rms_norm": [(4096, 1024), (8192, 4096), (16384, 8192)],
             "layer_norm": [(4096, 768), (8192, 4096), (16384, 8192)],
             "softmax": [(8, 12, 512), (8, 32, 1024), (4, 32, 2048)],  # batch, heads, sequence
             "cross_entropy": [(2048, 32000), (8192, 32000), (8192, 128256)],
             "batch_norm": [(32, 64, 56), (32, 256, 28), (64, 512, 14)],  # batch, channels, side
             "linear_cross_entropy": [(4096, 2048, 32000), (8192, 4096, 32000), (8192, 4096, 128256)]}  # tokens, hidden, vocab
CPU_SIZES = {"rms_norm": [(8, 64)], "layer_norm": [(8, 64)], "softmax": [(1, 2, 16)], "cross_entropy": [(8, 1000)],
             "batch_norm": [(2, 4, 6)], "linear_cross_entropy": [(8, 32, 1000)]}
TOLERANCE = 1e-4


def case(name: str, size, device):
    """(module, inputs, the input the bandwidth counts)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, grad=True):
        return torch.randn(*shape, device=device, generator=gen).requires_grad_(grad)

    if name in ("rms_norm", "layer_norm"):
        rows, width = size
        module = (RMSNorm if name == "rms_norm" else LayerNorm)(width).to(device)
        x = randn(rows, width)
        return module, (x, randn(rows, width, grad=False)), x
    if name == "softmax":
        batch, heads, seq = size
        scores = randn(batch, heads, seq, seq)
        mask = torch.full((seq, seq), float("-inf"), device=device).triu(1).expand(batch, 1, seq, seq).contiguous()
        return Softmax(), (scores, mask), scores
    if name == "cross_entropy":
        tokens, vocab = size
        logits = randn(tokens, vocab)
        return CrossEntropy(), (logits, torch.randint(0, vocab, (tokens,), device=device, generator=gen)), logits
    if name == "linear_cross_entropy":
        tokens, hidden, vocab = size
        x = randn(tokens, hidden)
        module = LinearCrossEntropy(hidden, vocab).to(device)
        return module, (x, torch.randint(0, vocab, (tokens,), device=device, generator=gen)), x
    batch, channels, side = size
    module = BatchNorm(channels).to(device)
    x = randn(batch, channels, side, side)
    return module, (x, randn(batch, channels, side, side, grad=False)), x


def liger(name: str, module, device):
    """Liger-Kernel's version of the case, or None (not installed, or no such kernel)."""
    try:
        import liger_kernel.transformers as lk
    except ImportError:
        return None
    if name == "rms_norm":
        norm = lk.LigerRMSNorm(module.weight.shape[0], eps=1e-6).to(device)
        norm.weight = module.weight
        return lambda x, residual: norm(x + residual)
    if name == "layer_norm":
        norm = lk.LigerLayerNorm(module.norm.weight.shape[0], eps=module.norm.eps).to(device)
        norm.weight, norm.bias = module.norm.weight, module.norm.bias
        return lambda x, residual: norm(x + residual)
    if name == "cross_entropy":
        return lk.LigerCrossEntropyLoss()
    if name == "linear_cross_entropy":
        loss = lk.LigerFusedLinearCrossEntropyLoss()
        return lambda x, target: loss(module.head.weight, x, target)
    return None


def run_step(fn, inputs, backward: bool, params=()):
    differentiable = [t for t in inputs if t.requires_grad] + list(params)

    def step():
        out = fn(*inputs)
        if backward:
            torch.autograd.grad(out, differentiable, torch.ones_like(out))
        return out
    return step


def peak(fn, device) -> int | None:
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device)


def measure(name: str, size, backward: bool, device, with_compile: bool, time_fn) -> dict:
    module, inputs, main = case(name, size, device)
    opt = graphopt.optimize(module, inputs, passes="fuse", train=True)
    stats = opt.graphopt_report.passes[-1].stats
    if stats["kernels"] != 1:
        raise RuntimeError(f"the fuse pass made {stats['kernels']} kernels of {name}; expected 1")
    params = list(module.parameters())  # the backward forms their gradients too, as a training step does
    eager_run, fused_run = run_step(module, inputs, backward, params), run_step(opt, inputs, backward, params)
    error = max_error(fused_run(), eager_run())
    if error > TOLERANCE:
        raise AssertionError(f"graphopt's {name} differs from eager by {error:.3g} (relative) at {size}")
    runs = {"eager": eager_run, "graphopt": fused_run}
    if with_compile:
        runs["compile"] = run_step(torch.compile(module), inputs, backward, params)
    other = liger(name, module, device) if device.type == "cuda" else None
    if other is not None:
        runs["liger"] = run_step(other, inputs, backward, params)
    seconds = {"copy": time_fn(lambda: main.detach().clone())}
    seconds.update({k: time_fn(fn) for k, fn in runs.items()})
    size_bytes = main.numel() * main.element_size()
    ideal = size_bytes * (5 if backward else 2)
    copy_bandwidth = 2 * size_bytes / seconds["copy"]
    row = {"case": name, "size": "x".join(map(str, size)), "pass": "fwd+bwd" if backward else "fwd",
           "max_rel_error": error}
    for method, s in seconds.items():
        row[f"{method}_us"] = round(s * 1e6, 2)
        if method != "copy":
            row[f"{method}_of_copy_bw"] = round(ideal / s / copy_bandwidth, 3)
    for method, fn in runs.items():
        measured = peak(fn, device)
        row[f"{method}_peak_mb"] = None if measured is None else round(measured / 1e6, 1)
    row["graphopt_speedup_over_eager"] = round(seconds["eager"] / seconds["graphopt"], 2)
    return row


def run(device=None, with_compile=None, log=print, seconds=None) -> dict:
    """Every case at every size, forward and forward+backward; with `seconds`, no row starts after that many
    seconds (the rows measured by then are returned, and how many were planned)."""
    deadline = None if seconds is None else time.perf_counter() + seconds
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with_compile = device.type == "cuda" if with_compile is None else with_compile
    sizes, time_fn = GPU_SIZES if device.type == "cuda" else CPU_SIZES, timer(device)
    # every case at the middle size first (a large model's), then the largest, then the smallest: a run cut
    # short still has each case
    count = max(len(shapes) for shapes in sizes.values())
    order = sorted(range(count), key=lambda i: (i != count // 2, -i))
    names = list(sizes)
    planned = [(c, i, backward) for i in order for c, name in enumerate(names) if i < len(sizes[name])
               for backward in (False, True)]
    measured = []
    for case_index, i, backward in planned:
        if deadline is not None and time.perf_counter() >= deadline:
            break
        name = names[case_index]
        try:
            row = measure(name, sizes[name][i], backward, device, with_compile, time_fn)
        except Exception as error:  # one case's failure is a row of the table; the run goes on
            row = failed_row(error, case=name, size="x".join(map(str, sizes[name][i])),
                             **{"pass": "fwd+bwd" if backward else "fwd"})
        log(row)
        measured.append(((case_index, i, backward), row))
    measured.sort(key=lambda item: item[0])
    return {"device": device_name(), "date": today(), "torch": torch.__version__, "triton": _version("triton"),
            "liger_kernel": _version("liger_kernel"),
            "mode": "gpu" if device.type == "cuda" else "cpu (reduced: Triton's interpreter, no torch.compile)",
            "rows": [row for _, row in measured], "planned_rows": len(planned),
            "stopped": None if len(measured) == len(planned)
            else f"the {seconds} s given ran out: {len(measured)} of {len(planned)} rows measured"}


def markdown(result: dict) -> str:
    lines = [f"# row kernels benchmark: {result['device']}, {result['date']}", "",
             f"torch {result['torch']}, triton {result['triton']}, liger-kernel {result['liger_kernel']}, "
             f"mode: {result['mode']}", ""]
    if result.get("stopped"):
        lines += [f"Stopped early: {result['stopped']}.", ""]
    lines += ["time per call, bandwidth as a fraction of a device copy, peak memory", ""]
    cols = list(dict.fromkeys(c for row in result["rows"] for c in row if c != "max_rel_error"))
    return "\n".join(lines + _table(cols, result["rows"])) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"),
                        help="directory for the JSON and markdown results (default: $OUT, else bench/results)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--seconds", type=float,
                        help="start no measurement after this many seconds; write what was measured")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # off CUDA, fuse runs its kernels only in the interpreter
    result = run(with_compile=False if args.no_compile else None, seconds=args.seconds)
    for path in write_results("rows", result, markdown(result), args.out):
        print(f"wrote {path}")
    return 1 if failures(result) else 0


if __name__ == "__main__":
    sys.exit(main())
