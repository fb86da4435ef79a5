"""The plan's host tier on a real step: a Llama (transformers) with AdamW planned below what its
device reaches, so its optimizer's state, step and, further down, its gradients and checkpoints go
to the host; measured against the prediction and against torchao's CPUOffloadOptimizer.

    python bench/gpu_host_step.py [--layers 8] [--width 1024] [--tokens 2048] [--steps 5] [--out FILE]

Per budget (1.05 and 1.5 x the least graphopt names with everything on the host): what the plan
moved, the predicted peak, the measured peak of a whole step (forward, backward, optimizer.step;
torch.cuda.max_memory_allocated on CUDA, the live storages of the device on CPU) and the median
step time; beside them the same model on the device with AdamW (eager) and with torchao's
CPUOffloadOptimizer (its state and step on the host; a row saying so where torchao is not
installed). Parameters in bf16 on CUDA (as users load them), float32 on CPU. Writes a markdown table
(default bench/results/gpu_host_step-<device>-<date>.md).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]  # graphopt from this checkout

import graphopt  # noqa: E402
from results_files import device_name, today, write_table  # noqa: E402  (bench/, beside this script)
from graphopt.analysis.memory import measure_peak  # noqa: E402

GB = 1e9


def llama(layers: int, width: int, tokens: int, device: torch.device, dtype):
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=width, intermediate_size=width * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=width // 64,
                                      num_key_value_heads=width // 128, max_position_embeddings=tokens,
                                      use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    ids = torch.randint(0, 32000, (1, tokens), device=device)
    return model, (ids,), {"labels": ids}


def timed_steps(module, optimizer, args, kwargs, steps: int, sync) -> tuple[float, int]:
    """(median seconds a step, peak device bytes of a step after the first: the model, its inputs and
    the optimizer's state on the device resident)."""
    def step():
        module(*args, **kwargs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer's state exists from here on
    sync()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    peak = measure_peak(step, module, *args, *kwargs.values(), *state)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak


def offloaded_blocks(model, args, kwargs, steps: int, sync) -> list[str]:
    """Table lines: the model's blocks checkpointed against the same blocks offloaded (their inputs on
    the host, copied on the copy streams), peak and median forward and backward, and whether a second
    batch's loss and gradients are equal bit for bit (what a race between the streams would break)."""
    from graphopt.analysis.blocks import outer_blocks
    from graphopt.passes.recompute.rewrite import checkpoint_segments

    ids = torch.randint(0, 32000, args[0].shape, device=args[0].device)  # not the example
    rows, results = [], []
    for offload in (False, True):
        gm = graphopt.trace(model, args, kwargs)
        nodes = list(gm.graph.nodes)
        blocks = [[nodes[i] for i in range(min(at), max(at) + 1)] for at in outer_blocks(nodes).values()]
        gm = checkpoint_segments(gm, blocks, offload=offload)
        times = []
        for _ in range(steps + 1):
            sync()
            start = time.perf_counter()
            gm(*args, **kwargs).loss.backward()
            sync()
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        peak = measure_peak(lambda: gm(*args, **kwargs).loss.backward(), gm, *args)
        model.zero_grad(set_to_none=True)
        loss = gm(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        model.zero_grad(set_to_none=True)
        rows.append((f"{len(blocks)} blocks {'offloaded' if offload else 'checkpointed'}", peak,
                     statistics.median(times[1:])))
    (loss_a, grads_a), (loss_b, grads_b) = results
    same = torch.equal(loss_a, loss_b) and len(grads_a) == len(grads_b) and all(map(torch.equal, grads_a, grads_b))
    verdict = "equal bit for bit" if same else "DIFFERENT"
    lines = ["", "Forward and backward, no optimizer: the blocks' inputs on the host against kept on the device. "
             f"Another batch's loss and gradients, offloaded against checkpointed: {verdict}.",
             "", "| step | measured peak | forward and backward | against checkpointed |", "|---|---:|---:|---:|"]
    for what, peak, seconds in rows:
        lines.append(f"| {what} | {peak / GB:.3f} GB | {seconds * 1e3:.1f} ms | {seconds / rows[0][2]:.2f} |")
    return lines


def llama_arguments(description: str) -> argparse.Namespace:
    """The command line of a script that steps llama(): its size, the steps timed and the table's file."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out")
    return parser.parse_args()


def main() -> int:
    a = llama_arguments(__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, args, kwargs = llama(a.layers, a.width, a.tokens, device, dtype)
    rows = []

    eager = copy.deepcopy(model)
    seconds, peak = timed_steps(eager, torch.optim.AdamW(eager.parameters()), args, kwargs, a.steps, sync)
    rows.append(("eager, AdamW on the device", None, "-", None, peak, seconds))
    base = seconds
    del eager
    try:
        from torchao.optim import CPUOffloadOptimizer

        eager = copy.deepcopy(model)
        offloaded = CPUOffloadOptimizer(eager.parameters(), torch.optim.AdamW)
        seconds, peak = timed_steps(eager, offloaded, args, kwargs, a.steps, sync)
        rows.append(("eager, torchao CPUOffloadOptimizer(AdamW)", None, "state and step", None, peak, seconds))
        del eager, offloaded
    except ImportError as e:
        rows.append((f"torchao CPUOffloadOptimizer: not installed ({e})", None, "-", None, None, None))

    probe = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", graphopt.BudgetWarning)
        try:
            graphopt.optimize(probe, args, kwargs, budget_gb=1e-9, optimizer=torch.optim.AdamW(probe.parameters()),
                              plan_cache=False)
            least = 0
        except graphopt.BudgetError as e:
            least = e.min_budget_bytes
    del probe
    for factor in (1.05, 1.5):
        trained = copy.deepcopy(model)
        adamw = torch.optim.AdamW(trained.parameters())
        budget = least * factor
        opt = graphopt.optimize(trained, args, kwargs, budget_gb=budget / GB, optimizer=adamw, plan_cache=False)
        report = opt.graphopt_report
        record = report.recompute()
        stats = record.stats
        moved = [report.host_step.moved] if report.host_step is not None else []
        if stats.get("offloaded_segments"):
            moved.append(f"{stats['offloaded_segments']} segments' inputs")
        seconds, peak = timed_steps(opt, adamw, args, kwargs, a.steps, sync)
        rows.append((f"graphopt at {factor:g} x its least", budget, ", ".join(moved) or "nothing",
                     record.budget.predicted_peak_bytes, peak, seconds))
        del trained, opt, adamw

    name = device_name()
    params = sum(p.numel() for p in model.parameters())
    lines = [f"# The host tier on a real step, {name}, {today()}", "",
             f"`python bench/gpu_host_step.py --layers {a.layers} --width {a.width} --tokens {a.tokens} --steps "
             f"{a.steps}`: a Llama of {params / 1e6:.0f}M parameters in {str(dtype).removeprefix('torch.')}, AdamW, "
             f"1 x {a.tokens} tokens; least budget with everything on the host: {least / GB:.3f} GB. Peak: "
             f"{'torch.cuda.max_memory_allocated' if cuda else 'live storages of the device'} over a step after the "
             "first; time: the median step.", "",
             "| step | budget | on the host | predicted peak | measured peak | measured / predicted | step time | "
             "against eager |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for what, budget, moved, predicted, peak, seconds in rows:
        ratio = f"{peak / predicted:.4f}" if predicted and peak else "-"
        lines.append(f"| {what} | {f'{budget / GB:.3f} GB' if budget else '-'} | {moved} | "
                     f"{f'{predicted / GB:.3f} GB' if predicted else '-'} | {f'{peak / GB:.3f} GB' if peak else '-'} | "
                     f"{ratio} | {f'{seconds * 1e3:.1f} ms' if seconds else '-'} | "
                     f"{f'{seconds / base:.2f}' if seconds else '-'} |")
    lines += offloaded_blocks(model, args, kwargs, a.steps, sync)
    write_table("gpu_host_step", "\n".join(lines) + "\n", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
