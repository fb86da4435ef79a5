"""Device memory a CUDA step holds that no tensor stands for: cuBLAS's workspaces.

torch gives each cuBLAS handle a workspace from its caching allocator the first time the handle
runs a matrix product on a stream, and keeps it for the life of the process (cuBLASLt shares it).
Handles are per thread: a training step's forward runs on the caller's thread and its backward on
autograd's thread for the device, so a step that multiplies matrices holds two, one without
backward. torch.cuda.max_memory_allocated counts them; FakeTensors show none (bench/gpu_memory_gap.py
shows them in the allocator's snapshots).
"""
from __future__ import annotations

import os
import re

import torch

from ..ops import lookup_target
from .planning_device import planning_device

HOPPER = 32 * 1024 * 1024  # torch's default on compute capability 9.0 (":4096:8")
OTHERS = 4096 * 1024 * 2 + 16 * 1024 * 8  # its default elsewhere (":4096:2:16:8")


def workspace_bytes(device: torch.device, environ=os.environ) -> int:
    """One handle's workspace on `device`, as torch sizes it: CUBLAS_WORKSPACE_CONFIG's ":SIZE_KiB:COUNT"
    pairs where set, else its default for the device's compute capability; for a device this process
    cannot see (a plan made without it), the larger default: a budget is a bound."""
    config = environ.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    if torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count():
        return HOPPER if torch.cuda.get_device_capability(device.index or 0) == (9, 0) else OTHERS
    return HOPPER


def held_bytes(func, args, threads: int) -> int:
    """What the step holds in cuBLAS workspaces once `func` runs, if it is a cuBLAS op (the registry's
    `blas`) on a CUDA tensor; else 0."""
    op = lookup_target(func)
    if op is None or not op.blas:
        return 0
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if device is not None and device.type != "cuda" and planning_device() == "cuda":
        device = torch.device("cuda")  # a fake on the CPU standing for CUDA's (graphopt.plan)
    return threads * workspace_bytes(device) if device is not None and device.type == "cuda" else 0
