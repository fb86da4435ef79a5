"""What users compare, on one GPU: a training step under eager, torch.autocast, torch.compile (default
and mode="reduce-overhead"), graphopt's defaults, graphopt bf16 and graphopt with CUDA graphs, all
measured in this process, each a ratio to eager's; and the memory promise on five corpus models,
each in a process of its own.

    python bench/gpu_step_time.py --out DIR [--seconds S] [--models gpt2_124m,llama_small,hf_gpt2]
    python bench/gpu_step_time.py --memory all --out DIR [--seconds S]   # the memory rows

Models: transformers GPT-2 at its 124M shape (12 layers, 768 wide, 8 x 512 tokens), a small
transformers Llama (8 layers, 1024 wide, 4 KV heads, 4 x 512 tokens) and the corpus's GPT-2 config
(tests/corpus: 2 layers, 64 wide, 2 x 32 tokens: host-bound); dropout off, so that steps compare.
A step is the model's forward with its loss and the backward, gradients set to None before; its
time the median of --steps steps after warm-up, CUDA events around each. Rows: per model,
float32 (eager, torch.compile, its reduce-overhead mode, graphopt's defaults, graphopt with
cuda_graphs=True) and bfloat16 (torch.autocast, torch.compile of the autocast step and its
reduce-overhead mode, graphopt precision="bf16", the same with CUDA graphs); every column also as
a ratio to the float32 row's eager. Checks per model, at the first step: graphopt's loss and
gradients with its kernels' launchers bound equal those launched through Triton's JITFunction
(runtime/launch.BIND_LAUNCHERS), and the CUDA-graphed step's equal the uncaptured graph's. A
torch.profiler table of graphopt's step (profile-<model>-<dtype>.txt) goes beside the rows.

Memory (--memory all: each model of MEMORY in a process of its own, --memory NAME running one):
the corpus model at the memory tests' batch on the device, unplanned and at budgets of parameters
and gradients plus 0.3 and 0.5 of the rest of the step (corpus/memory.py): predicted peak against
the measured one (torch.cuda.max_memory_allocated), every budget held.

Writes DIR/step_time.json (one object per row: model, dtype, tokens and a *_ms field per column)
and step_time.md with the profiles, or DIR/memory_step.json and memory_step.md. Without CUDA: the
corpus GPT-2 alone, kernels in Triton's interpreter, no torch.compile (its CPU code says nothing
of the GPU's).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():  # before Triton is imported: @triton.jit decides then whether to interpret
    os.environ.setdefault("TRITON_INTERPRET", "1")

import graphopt  # noqa: E402
from graphopt.frontend.export_batch import ExportCache, keeping_exports  # noqa: E402
from graphopt.runtime import launch  # noqa: E402
from results_files import device_name, today  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
MODELS = ("gpt2_124m", "hf_gpt2", "llama_small")  # most telling first: a run cut short has them
MEMORY = ("hf_gpt2", "hf_llama", "hf_bert", "hf_t5", "hf_mistral")
# issue 62's goals on a GPU: (column, over column, at most) per dtype
GOALS = {"bfloat16": [("graphopt_bf16_ms", "autocast_ms", 1.05), ("graphopt_bf16_ms", "compile_ms", 1.2),
                      ("graphopt_bf16_cuda_graphs_ms", "compile_reduce_overhead_ms", 1.0)],
         "float32": [("graphopt_ms", "eager_ms", 1.0), ("graphopt_cuda_graphs_ms", "compile_reduce_overhead_ms", 1.0)]}


def build(name: str):
    """(model, args, kwargs, tokens) on the device, in training mode, dropout off."""
    import transformers

    torch.manual_seed(0)
    if name == "gpt2_124m":
        config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        model, shape = transformers.GPT2LMHeadModel(config), (8, 512)
    elif name == "llama_small":
        config = transformers.LlamaConfig(num_hidden_layers=8, hidden_size=1024, intermediate_size=2816,
                                          num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                          max_position_embeddings=1024, use_cache=False)
        model, shape = transformers.LlamaForCausalLM(config), (4, 512)
    else:
        from corpus import transformers_models
        case = transformers_models.BUILDERS[name]()
        model, ids = case.model, case.args[0]
        for m in model.modules():  # the corpus keeps the library's dropout: off here, so that steps compare
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        shape = tuple(ids.shape)
    ids = torch.randint(0, model.config.vocab_size, shape, device=DEVICE)
    model.to(DEVICE).train()
    return model, (ids,), {"labels": ids}, shape[0] * shape[1]


def step_of(module, args, kwargs, dtype=None):
    def step():
        for p in module.parameters():
            p.grad = None
        with torch.autocast(DEVICE.type, dtype=dtype, enabled=dtype is not None):
            loss = module(*args, **kwargs).loss
        loss.backward()
        return loss
    return step


def timed(step, steps: int) -> float:
    """Median milliseconds of a step, after warm-up (CUDA events; wall time without CUDA)."""
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
    return round(sorted(times)[len(times) // 2], 3)


def gradients(model, step) -> tuple[torch.Tensor, list]:
    loss = step().detach().clone()
    return loss, [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def differ(a, b) -> float:
    """The largest relative difference between two (loss, gradients) results."""
    worst = float((a[0].float() - b[0].float()).abs() / b[0].float().abs().clamp_min(1e-12))
    for x, y in zip(a[1], b[1]):
        if x is not None and y is not None:
            worst = max(worst, float((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-12)))
    return worst


def profile(step, path: Path) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if CUDA else [])
    step()
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if CUDA:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if CUDA else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=25) + "\n")


def model_rows(name: str, steps: int, out: Path, deadline: float) -> list[dict]:
    model, args, kwargs, tokens = build(name)
    rows = []
    with keeping_exports(ExportCache()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in (torch.bfloat16, torch.float32):  # bf16 first: the step users train in
            if time.perf_counter() > deadline:
                break
            low = dtype == torch.bfloat16
            label = "bfloat16" if low else "float32"
            row = {"model": name, "dtype": label, "tokens": tokens}
            eager = step_of(model, args, kwargs, dtype if low else None)
            row["autocast_ms" if low else "eager_ms"] = timed(eager, steps)
            if CUDA:
                compiled = torch.compile(model)
                row["compile_ms"] = timed(step_of(compiled, args, kwargs, dtype if low else None), steps)
                torch._dynamo.reset()
                reduced = torch.compile(model, mode="reduce-overhead")
                row["compile_reduce_overhead_ms"] = timed(step_of(reduced, args, kwargs, dtype if low else None), steps)
                torch._dynamo.reset()
            precision = "bf16" if low else None
            opt = graphopt.optimize(model, args, example_kwargs=kwargs, precision=precision)
            key = "graphopt_bf16" if low else "graphopt"
            row[f"{key}_ms"] = timed(step_of(opt, args, kwargs), steps)
            fuse = next((p.stats for p in opt.graphopt_report.passes if p.name == "fuse"), {})
            row["kernels"], row["left_eager"] = fuse.get("kernels", 0), fuse.get("left_eager", 0)
            bound = gradients(model, step_of(opt, args, kwargs))
            launch.BIND_LAUNCHERS[0] = False
            try:
                unbound = gradients(model, step_of(graphopt.optimize(model, args, example_kwargs=kwargs,
                                                                     precision=precision), args, kwargs))
            finally:
                launch.BIND_LAUNCHERS[0] = True
            row["bound_launchers_differ"] = differ(bound, unbound)
            profile(step_of(opt, args, kwargs), out / f"profile-{name}-{label}.txt")
            if CUDA:
                try:
                    graphed = graphopt.optimize(model, args, example_kwargs=kwargs, precision=precision,
                                                cuda_graphs=True)
                    row[f"{key}_cuda_graphs_ms"] = timed(step_of(graphed, args, kwargs), steps)
                    row["cuda_graphs_differ"] = differ(gradients(model, step_of(graphed, args, kwargs)), bound)
                except graphopt.GraphoptError as e:
                    row["cuda_graphs_refused"] = str(e)[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def ratios(rows: list[dict]) -> None:
    """Each *_ms over the model's float32 eager, and the goals' ratios."""
    eager = {r["model"]: r["eager_ms"] for r in rows if "eager_ms" in r}
    for r in rows:
        base = eager.get(r["model"])
        for k in [k for k in r if k.endswith("_ms")]:
            if base:
                r[k[:-3] + "_over_eager"] = round(r[k] / base, 3)
        for column, over, goal in GOALS[r["dtype"]]:
            if column in r and over in r:
                r[f"{column[:-3]}_over_{over[:-3]}"] = round(r[column] / r[over], 3)
                r[f"{column[:-3]}_over_{over[:-3]}_goal"] = goal


def memory_rows(name: str) -> dict:
    """One corpus model's memory points on the device (corpus/memory.py), each budget held."""
    from corpus.memory import memory_case, memory_points, point_problems
    from recompute_sweep import _loss_to, _to

    case = memory_case(name)
    case.model.to(DEVICE)
    case.args, case.kwargs = _to(case.args, DEVICE), _to(case.kwargs, DEVICE)
    case.loss = _loss_to(case.loss, DEVICE)
    points = memory_points(case, fractions=(0.3, 0.5), own=False)
    return {"model": name, "points": [{"label": p.label, "budget_bytes": p.budget, "predicted_bytes": p.predicted,
                                       "measured_bytes": p.measured, "refused": p.refused,
                                       "problems": point_problems(p)} for p in points]}


def memory_all(deadline: float) -> list[dict]:
    """Each model of MEMORY in a process of its own (a model's allocations and CUDA context do not
    reach the next one's measurement)."""
    found = []
    for name in MEMORY:
        left = deadline - time.perf_counter()
        if left < 20:
            break
        try:
            done = subprocess.run([sys.executable, __file__, "--memory", name], capture_output=True, text=True,
                                  timeout=left)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            found.append(json.loads(lines[-1]) if lines else {"model": name, "error": done.stderr[-500:]})
        except subprocess.TimeoutExpired:
            found.append({"model": name, "error": f"not done within {left:.0f} s"})
        print(json.dumps(found[-1]), flush=True)
    return found


def memory_markdown(memory: list[dict]) -> str:
    lines = [f"# The memory promise on {device_name()} ({today()}, torch {torch.__version__})", "",
             "Each model in a process of its own; predicted against measured step peak, budgets held.", "",
             "| model | point | budget MB | predicted MB | measured MB | problems |", "|---|---|---|---|---|---|"]
    mb = (lambda v: f"{v / 1e6:.1f}" if v else "")
    for m in memory:
        for p in m.get("points", []):
            lines.append(f"| {m['model']} | {p['label']} | {mb(p['budget_bytes'])} | {mb(p['predicted_bytes'])} | "
                         f"{mb(p['measured_bytes'])} | {'; '.join(p['problems']) or p['refused'] or ''} |")
        if "error" in m:
            lines.append(f"| {m['model']} | failed: {m['error'][-200:]} | | | | |")
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict]) -> str:
    columns = ["eager_ms", "autocast_ms", "compile_ms", "compile_reduce_overhead_ms", "graphopt_ms",
               "graphopt_cuda_graphs_ms", "graphopt_bf16_ms", "graphopt_bf16_cuda_graphs_ms"]
    lines = [f"# Training step time on {device_name()} ({today()}, torch {torch.__version__})", "",
             "ms per step (forward, loss, backward), median; in brackets, over float32 eager.", "",
             "| model | dtype | tokens | " + " | ".join(c[:-3] for c in columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    for r in rows:
        cells = [f"{r[c]} ({r.get(c[:-3] + '_over_eager', '')})" if c in r else "" for c in columns]
        lines.append(f"| {r['model']} | {r['dtype']} | {r['tokens']} | " + " | ".join(cells) + " |")
    lines.append("")
    for r in rows:
        goals = [f"{k[:-5]} {r[k[:-5]]} (goal <= {r[k]})" for k in r if k.endswith("_goal")]
        checks = [f"bound launchers differ by {r.get('bound_launchers_differ')}",
                  f"CUDA graphs differ by {r.get('cuda_graphs_differ', r.get('cuda_graphs_refused', 'not run'))}"]
        lines.append(f"- {r['model']} {r['dtype']}: " + "; ".join(goals + checks))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--seconds", type=float, default=600.0, help="start no row after this many seconds")
    parser.add_argument("--steps", type=int, default=20 if CUDA else 3)
    parser.add_argument("--models", default=",".join(MODELS if CUDA else ("hf_gpt2",)))
    parser.add_argument("--memory", help="'all': the memory rows, each model in a process of its own; a corpus "
                                         "model's name: that model's, printed as JSON")
    options = parser.parse_args(argv)
    if options.memory and options.memory != "all":
        print(json.dumps(memory_rows(options.memory)), flush=True)
        return 0
    deadline = time.perf_counter() + options.seconds
    options.out.mkdir(parents=True, exist_ok=True)
    if options.memory:
        memory = memory_all(deadline)
        (options.out / "memory_step.json").write_text(json.dumps(memory, indent=2) + "\n")
        (options.out / "memory_step.md").write_text(memory_markdown(memory))
        print(memory_markdown(memory))
        return 0
    rows = []
    for name in options.models.split(","):
        if time.perf_counter() > deadline:
            break
        rows += model_rows(name, options.steps, options.out, deadline)
        ratios(rows)  # written after each model: a run stopped at its limit keeps what it measured
        (options.out / "step_time.json").write_text(json.dumps(rows, indent=2) + "\n")
        (options.out / "step_time.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
