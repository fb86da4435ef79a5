"""Helpers for tests and benchmarks that need several ranks on one machine."""
from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn, world: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def on_gloo_ranks(fn, world: int, *args) -> list:
    """fn(rank, world, *args) on `world` spawned processes joined by a gloo process group;
    the list of what each rank returned. fn must be importable (a module-level function).

    torch.multiprocessing.spawn raises as soon as a rank fails (with its traceback), rather
    than leaving the others waiting on a peer that is gone; results travel through files, as
    a queue holding unread results would keep its writer from exiting.
    """
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(fn, world, free_port(), out, args), nprocs=world, join=True)
        return [torch.load(os.path.join(out, f"{rank}.pt"), weights_only=False) for rank in range(world)]
