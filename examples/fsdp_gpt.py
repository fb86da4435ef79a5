"""Train the zoo GPT sharded with FSDP2, one unit per block, under a memory budget per rank.

    torchrun --nproc-per-node 2 examples/fsdp_gpt.py                         # gloo on CPU
    torchrun --nproc-per-node 4 examples/fsdp_gpt.py --budget-gb 0.05        # recompute to fit a rank's budget
    torchrun --nproc-per-node 2 examples/fsdp_gpt.py --device cuda           # NCCL on GPUs
    torchrun --nproc-per-node 2 examples/fsdp_gpt.py --budget-gb 0.02 --train-step   # 8 microbatches

Every rank builds the same model and lets graphopt make each block a unit (the rewrite is
deterministic), plans recompute so one rank's step fits --budget-gb (its shard of parameters,
gradients and AdamW state, the gathered units, activations), shards the units and the root with
fully_shard, and trains on its own batch. With --train-step, graphopt.train_step also splits each
rank's batch into the fewest microbatches whose step fits, their gradients accumulated sharded.
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import graphopt
from graphopt.runtime.fsdp import fully_shard_units
from graphopt.testing import zoo

from torchrun_setup import start  # examples/, beside this script


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gb", type=float, default=None, help="one rank's peak, in GB of 10**9 bytes")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--train-step", action="store_true", help="graphopt.train_step: microbatches where needed")
    options = parser.parse_args()
    rank, world, device = start(parser, options.device, "examples/fsdp_gpt.py")

    torch.manual_seed(0)  # the same weights on every rank; fully_shard keeps each rank's shard
    with device:
        model, _, _ = zoo.gpt(batch=16, seq=64, layers=8, dim=128, heads=4)
    torch.manual_seed(1 + rank)  # each rank its own batch
    idx = torch.randint(0, 256, (16, 64), device=device)
    targets = torch.randint(0, 256, (16, 64), device=device)
    plan = dict(shard="fsdp", world_size=world, budget_gb=options.budget_gb, optimizer="adamw")
    if options.train_step:
        train = graphopt.train_step(model, (idx,), {"targets": targets}, **plan)
        gm = train.graph
    else:
        gm = graphopt.optimize(model, (idx,), example_kwargs={"targets": targets}, **plan)

        def train(idx, targets):
            loss = gm(idx, targets=targets).loss
            loss.backward()
            return loss.detach()
    if rank == 0:
        print(gm.graphopt_report.to_text())
    fully_shard_units(gm, mesh=init_device_mesh(device.type, (world,)))
    optimizer = torch.optim.AdamW(gm.parameters(), lr=3e-4)
    for step in range(options.steps):
        loss = train(idx, targets=targets)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} (rank 0's batch)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
