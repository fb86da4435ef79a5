"""Train the zoo GPT over a pipeline of stages, one per rank.

    torchrun --nproc-per-node 4 examples/pipeline_gpt.py                     # gloo on CPU
    torchrun --nproc-per-node 4 examples/pipeline_gpt.py --schedule interleaved-1f1b
    torchrun --nproc-per-node 2 examples/pipeline_gpt.py --frontend export   # torch.export's ATen graph
    torchrun --nproc-per-node 2 examples/pipeline_gpt.py --device cuda       # NCCL on GPUs

Every rank builds the same model and lets graphopt cut it into balanced stages (the cut is
deterministic); each keeps its own stages and runs the schedule on torch.distributed.pipelining.
"""
import argparse

import torch
import torch.distributed as dist

import graphopt
from graphopt.runtime.pipeline import PipelineRunner
from graphopt.testing import zoo

from torchrun_setup import start  # examples/, beside this script


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved-1f1b"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--frontend", default="fx", choices=["fx", "export"])
    options = parser.parse_args()
    rank, world, device = start(parser, options.device, "examples/pipeline_gpt.py")

    # The same model on every rank, built on the host: the runner moves only its stages to `device`.
    torch.manual_seed(0)
    model, args, kwargs = zoo.gpt(batch=16, seq=64, layers=8, dim=128, heads=4)
    stages = world * (2 if options.schedule == "interleaved-1f1b" else 1)
    # The pass plans for the schedule and microbatches the runner will run (its memory model).
    plan = f"pipeline{{stages={stages} microbatches={options.microbatches} schedule={options.schedule}}}"
    staged = graphopt.optimize(model, args, example_kwargs=kwargs, passes=["normalize", "cse", "dce", plan],
                               frontend=options.frontend)
    if rank == 0:
        print(staged.graphopt_report.to_text())
    runner = PipelineRunner(staged, rank, world, device, example_args=args, example_kwargs=kwargs,
                            loss_fn=lambda out, target: out.loss)
    optimizer = torch.optim.AdamW(runner.parameters(), lr=3e-4)
    for step in range(options.steps):
        losses = runner.step(*args, **kwargs)
        runner.sync_tied_grads()
        optimizer.step()
        optimizer.zero_grad()
        if losses:
            print(f"step {step}: loss {torch.stack(losses).mean().item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
