"""A rank's peak under FSDP2 per block, graphopt against what users already have, in one run on
gloo ranks (CPU): eager FSDP2, eager FSDP2 with the model's own checkpointing (every block), and
graphopt's units unplanned, at the peak own checkpointing reaches, and at graphopt's least budget
per rank; then own checkpointing with 2 microbatches accumulated by hand, and graphopt.train_step
(the fewest microbatches that fit) at that peak and at its least; then own checkpointing with
FSDP2's CPUOffloadPolicy, against graphopt's least, which keeps a rank's shards on the host so
too. Each rank measured by torch's FSDPMemTracker through a real step (the optimizer's state made
by a step before), beside graphopt's prediction: with the shards on the host, the device's part
(what the tracker counts less the sharded parameters, gradients and optimizer state: on gloo
they are the host's own memory). Step times as ratios to eager's.

    python bench/fsdp_ranks.py [--world 2] [--out bench/results/fsdp_ranks-cpu-2-cores-<date>.md]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import time
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

import graphopt
from graphopt.passes.shard.rank_memory import step_peak
from graphopt.runtime.fsdp import fully_shard_units, state_on_host
from graphopt.runtime.microbatch import split_batch
from graphopt.testing.gloo import on_gloo_ranks


def zoo_gpt():
    from graphopt.testing import zoo

    model, args, kwargs = zoo.gpt(batch=8, seq=128, layers=6, dim=128, heads=4)
    return model, args, kwargs, list(model.blocks), lambda out: out.loss


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 512, (4, 128))
    return model, (ids,), {"labels": ids}, list(model.model.layers), lambda out: out.loss


MODELS = {"zoo GPT (6 blocks)": zoo_gpt, "transformers Llama (6 layers)": hf_llama}


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if hasattr(m, "dropout") and isinstance(m.dropout, float):
            m.dropout = 0.0


def _by_hand(module, args, kwargs, loss_of, k):
    """Forward and backward as k equal microbatches, gradients accumulated (each loss a mean over
    equally many targets here, weighted 1/k): what users write when a batch does not fit."""
    def run():
        for a, kw in split_batch(args, kwargs, k):
            (loss_of(module(*a, **kw)) / k).backward()
    return run


def _run(module, args, kwargs, run, host: bool, steps=3):
    """(peak bytes of the second step, the device's part where host, median seconds of the later
    steps); run(): forward and backward."""
    optimizer = torch.optim.AdamW(module.parameters())
    peak = step_peak(module, optimizer, args, kwargs, run=run, host=host)["Total"]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return peak, statistics.median(times)


def _least(build) -> float:
    """The least budget per rank graphopt names (build(budget_gb) refused far below it)."""
    try:
        build(1e-6)
    except graphopt.BudgetError as e:
        return e.min_budget_gb
    raise AssertionError("a step that fits in 1 kB")


def _rank(rank, world, name, how, budget_gb):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model, args, kwargs, blocks, loss_of = MODELS[name]()
    _no_dropout(model)
    predicted, microbatches = None, 1
    if how.startswith("eager"):
        if "own checkpointing" in how:
            for block in blocks:
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        host = "CPUOffloadPolicy" in how
        policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if host else {}
        for k, block in enumerate(blocks):
            fully_shard(block, mesh=mesh, reshard_after_forward=k < len(blocks) - 1, **policy)
        fully_shard(model, mesh=mesh, **policy)
        microbatches = 2 if "2 microbatches" in how else 1
        run = _by_hand(model, args, kwargs, loss_of, microbatches)
        module = model
    else:
        if how == "train_step":
            def build(budget):
                return graphopt.train_step(model, args, kwargs, shard="fsdp", world_size=world, optimizer="adamw",
                                           budget_gb=budget)
        else:
            def build(budget):
                return graphopt.optimize(model, args, example_kwargs=kwargs, shard="fsdp", world_size=world,
                                         optimizer="adamw", budget_gb=budget)
        if budget_gb == "least":
            budget_gb = _least(build)
        try:
            built = build(budget_gb)
        except graphopt.BudgetError as e:  # below what graphopt plans for: the row says its least
            return {"peak": None, "seconds": None, "predicted": None, "budget_gb": budget_gb,
                    "refused": e.min_budget_gb}
        module = built.graph if how == "train_step" else built
        stats = module.graphopt_report.passes[-1].stats
        slack = stats["rank_collective_slack_bytes"]
        predicted = (built.predicted_peak_bytes - slack if how == "train_step" else stats["rank_peak_bytes"], slack)
        host = state_on_host(module)
        fully_shard_units(module, mesh=mesh)
        if how == "train_step":
            microbatches, run = built.microbatches, (lambda: built(*args, **kwargs))
        else:
            run = _by_hand(module, args, kwargs, loss_of, 1)
    peak, seconds = _run(module, args, kwargs, run, host)
    return {"peak": peak, "seconds": seconds, "predicted": predicted, "budget_gb": budget_gb,
            "microbatches": microbatches, "host": host}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    day = datetime.date.today().isoformat()
    out = Path(options.out or f"bench/results/fsdp_ranks-cpu-{options.world}-ranks-{day}.md")
    lines = [f"# A rank's peak under FSDP2 per block, {options.world} gloo ranks on CPU ({day})", "",
             "`python bench/fsdp_ranks.py --world {}`: each rank's peak through a step, measured by torch's "
             "FSDPMemTracker (the optimizer's state made by a step before); graphopt's prediction "
             "(+ what a collective may still hold); step time as a ratio to eager FSDP2's (median of 3).".format(
                 options.world), ""]
    for name in MODELS:
        eager = on_gloo_ranks(_rank, options.world, name, "eager", None)
        own = on_gloo_ranks(_rank, options.world, name, "eager + own checkpointing", None)
        halves = on_gloo_ranks(_rank, options.world, name, "eager + own checkpointing, 2 microbatches", None)
        hosted = on_gloo_ranks(_rank, options.world, name, "eager + own checkpointing + CPUOffloadPolicy", None)
        runs = [("eager FSDP2", eager), ("eager FSDP2 + own checkpointing", own),
                ("graphopt, no budget", on_gloo_ranks(_rank, options.world, name, "graphopt", None)),
                ("graphopt at own checkpointing's peak",
                 on_gloo_ranks(_rank, options.world, name, "graphopt", max(r["peak"] for r in own) / 1e9)),
                ("graphopt at its least budget", on_gloo_ranks(_rank, options.world, name, "graphopt", "least")),
                ("eager FSDP2 + own checkpointing, 2 microbatches by hand", halves),
                ("graphopt train_step at that peak",
                 on_gloo_ranks(_rank, options.world, name, "train_step", max(r["peak"] for r in halves) / 1e9)),
                ("graphopt train_step at its least budget",
                 on_gloo_ranks(_rank, options.world, name, "train_step", "least")),
                ("eager FSDP2 + own checkpointing + CPUOffloadPolicy", hosted),
                ("graphopt at that peak",
                 on_gloo_ranks(_rank, options.world, name, "graphopt", max(r["peak"] for r in hosted) / 1e9))]
        base = statistics.median(r["seconds"] for r in eager)
        lines += [f"## {name}", "", "| run | budget per rank | microbatches | shards on the host | predicted (+slack) "
                  "| measured per rank | vs eager's peak | step time vs eager |", "|---|---|---|---|---|---|---|---|"]
        for label, ranks in runs:
            budget = ranks[0]["budget_gb"]
            if ranks[0].get("refused"):
                lines.append(f"| {label} | {budget * 1e3:.2f} MB | - | - | refused: a rank needs "
                             f"{ranks[0]['refused'] * 1e3:.2f} MB by the estimate | - | - | - |")
                continue
            measured = [r["peak"] for r in ranks]
            predicted = ranks[0]["predicted"]
            lines.append(
                f"| {label} | {f'{budget * 1e3:.2f} MB' if budget else '-'} | {ranks[0]['microbatches']} | "
                f"{'yes' if ranks[0]['host'] else 'no'} | "
                f"{f'{predicted[0] / 1e6:.2f} MB (+{predicted[1] / 1e6:.2f})' if predicted else '-'} | "
                f"{', '.join(f'{m / 1e6:.2f} MB' for m in measured)} | "
                f"{max(measured) / max(r['peak'] for r in eager):.2f} | "
                f"{statistics.median(r['seconds'] for r in ranks) / base:.2f} |")
        lines.append("")
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
