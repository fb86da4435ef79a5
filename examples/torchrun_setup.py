"""What every example run under torchrun does first: this process's rank, the world, and its device
(a GPU per local rank with NCCL, or the CPU with gloo), with the process group started."""
import os

import torch
import torch.distributed as dist

import graphopt
from graphopt.runtime.devices import check_device


def start(parser, device: str, script: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device), or parser.error saying how to run `script` or what is missing."""
    if "RANK" not in os.environ:
        parser.error(f"run it with torchrun, which starts one process per rank: torchrun --nproc-per-node 2 {script}")
    try:
        chosen = check_device(f"cuda:{os.environ['LOCAL_RANK']}" if device == "cuda" else "cpu")
    except graphopt.UsageError as e:
        parser.error(str(e))
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    dist.init_process_group("nccl" if chosen.type == "cuda" else "gloo")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), chosen
