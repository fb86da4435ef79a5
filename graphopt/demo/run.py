"""`make demo`: what graphopt does to one training step, in measured numbers and a picture.

A Llama-shaped causal LM (transformers' LlamaForCausalLM when transformers is installed, else
graphopt's own GPT), sized so that activations outweigh parameters, is stepped eagerly, then
through optimize() at a budget of about half its activations, alone and with the passes that
apply on its device. Every line is measured in the same run; `record_markdown` writes the run
down with its date and machine (docs/demo.md).
"""
from __future__ import annotations

import datetime
import os
import platform
import sys
import time

import torch

from ..analysis.memory import GB, size_text
from ..runtime.step import step_peak
from .before_after import BeforeAfter, measure

BATCH, TOKENS, WIDTH, LAYERS = 4, 256, 256, 4


def demo_model(device: str = "cpu") -> tuple[torch.nn.Module, tuple, dict, str]:
    """(model, args, kwargs, description): the model computes its own loss from labels."""
    torch.manual_seed(0)
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is not None:
        config = transformers.LlamaConfig(vocab_size=2048, hidden_size=WIDTH, intermediate_size=4 * WIDTH,
                                          num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4,
                                          max_position_embeddings=TOKENS, use_cache=False)
        model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(0, config.vocab_size, (BATCH, TOKENS))
        kind = "transformers LlamaForCausalLM"
    else:
        from ..testing import zoo

        model, (ids,), _ = zoo.gpt(batch=BATCH, seq=TOKENS, layers=LAYERS, dim=WIDTH, heads=8)
        kind = "graphopt's GPT (transformers is not installed)"
    model.train().to(device)
    ids = ids.to(device)
    params = sum(p.numel() for p in model.parameters())
    text = (f"{kind}: {LAYERS} layers, {WIDTH} wide, {params / 1e6:.1f} M parameters; "
            f"batch {BATCH} x {TOKENS} tokens")
    return model, (ids,), {"labels": ids}, text


def demo_configs(budget_gb: float, device: str) -> dict[str, dict]:
    """The budget with the default passes, then with fuse where its kernels pay (CUDA), then in
    bf16. No line of inplace beside the budget: the default passes already run its writes inside
    the recompute plan, and run before the plan it was measured to raise the peak."""
    configs = {"graphopt: budget": {"budget_gb": budget_gb}}
    if device == "cuda":
        configs["budget + fuse"] = {"passes": "normalize,cse,dce,fuse", "budget_gb": budget_gb}
    configs["budget + bf16"] = {"budget_gb": budget_gb, "precision": "bf16"}
    return configs


def run_demo(dump_dir: str, share: float = 0.5, device: str = "cpu", progress=None) -> tuple[BeforeAfter, int]:
    """The demo's measurements, written to dump_dir; (result, exit status): 1 when a measured
    peak exceeds the budget. result.seconds: the wall time since the process started."""
    started = time.perf_counter()

    def say(text):
        (progress or (lambda t: print(f"  [{time.perf_counter() - started:5.1f} s] {t}", file=sys.stderr,
                                     flush=True)))(text)

    model, args, kwargs, text = demo_model(device)
    print(f"graphopt demo: {text}, training step on {device}")
    say("measuring the eager step")
    eager = step_peak(model, model, args, kwargs)
    fixed = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # parameters and their gradients
    budget = fixed + share * (eager - fixed)
    say(f"eager peak {size_text(eager)}; budget = parameters + gradients + {share:.0%} of the rest "
        f"= {size_text(int(budget))}")
    result = measure(model, args, kwargs, demo_configs(budget / GB, device), budget_bytes=int(budget),
                     name=text, progress=say, dump_dir=dump_dir)
    result.seconds = process_seconds() or time.perf_counter() - started
    result.write(dump_dir)
    say("done")
    return result, 1 if result.over_budget() else 0


def process_seconds() -> float | None:
    """Wall time since this process started, imports included, as `time` would report it; None
    where /proc does not say (then the caller counts from the model's build)."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None


def dumps_line(result: BeforeAfter, dump_dir: str) -> str:
    """Which configuration the pass-by-pass dumps in dump_dir show: measure() dumps the first only."""
    return (f"pass-by-pass dumps in {dump_dir}: the {result.dumped!r} configuration's (NN-pass.py, .txt, .diff); "
            "the other configurations are in the table only")


def machine() -> dict[str, str]:
    """What the demo's numbers depend on: the CPU (and whether it has bf16 instructions), the
    cores, torch's threads and the load at the time, the OS, torch."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    cpu = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass  # not Linux: the processor's name as platform gives it, its flags unknown
    bf16 = sorted(flags & {"avx512_bf16", "amx_bf16"})
    info = {"cpu": cpu, "cores": str(os.cpu_count()), "torch threads": str(torch.get_num_threads())}
    if flags:
        info["bf16 instructions"] = ", ".join(bf16) if bf16 else "none"
    if hasattr(os, "getloadavg"):
        info["load average (1 min) at the end"] = f"{os.getloadavg()[0]:.1f}"
    info.update({"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__})
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def record_markdown(result: BeforeAfter, table: str, dump_dir: str, command: str = "python -m graphopt demo",
                    when: datetime.datetime | None = None, host: dict[str, str] | None = None,
                    cpu_seconds: float | None = None) -> str:
    """The demo's run written down: the command, its date, the machine, the total time, the table
    as the terminal showed it, and which configuration the dumps belong to."""
    when = when or datetime.datetime.now().astimezone()
    host = host if host is not None else machine()
    cpu_seconds = time.process_time() if cpu_seconds is None else cpu_seconds
    lines = [f"# A recorded run of `{command}`", "",
             f"Run on {when:%Y-%m-%d %H:%M %Z}; total time {result.seconds:.0f} s wall clock, {cpu_seconds:.0f} s "
             "of CPU (all threads), install not included.", "", "Machine:", ""]
    lines += [f"- {key}: {value}" for key, value in host.items()]
    lines += ["", "```", table.rstrip("\n"), "```", "",
              "Every line is measured in this run: peaks are live tensor bytes on CPU (the allocator's peak on "
              "CUDA), times are medians of steps run in turns, so drift on a shared machine falls on every line "
              "alike; absolute times move with the machine's load, ratios less.", "",
              dumps_line(result, dump_dir) + "."]
    return "\n".join(lines) + "\n"
