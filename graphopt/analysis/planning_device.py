"""The device a plan is made for when the model is not on it (graphopt.plan on the meta device).

Inside planning_for(device), analyses treat meta tensors as tensors on `device`: fake_state
makes their fakes on the CPU, so that ops run a real device's kernels (a meta tensor's
scaled_dot_product_attention takes the math path, which keeps the attention weights; the
CPU's and CUDA's fused kernels keep only the output and its log-sum-exp); meta.graph_device
answers `device`, so costs, autocast's lists and the recompute headroom are that device's;
live_storage applies its allocator's rules. A CUDA fake cannot be made where torch is built
without CUDA, so for "cuda" the CPU's kernels stand in for CUDA's.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.fx

_PLANNING: contextvars.ContextVar[str | None] = contextvars.ContextVar("graphopt_planning", default=None)


@contextlib.contextmanager
def planning_for(device: str):
    """Analyses in this context treat meta tensors as tensors on `device` ("cpu" or "cuda")."""
    token = _PLANNING.set(device)
    try:
        yield
    finally:
        _PLANNING.reset(token)


def planning_device() -> str | None:
    """The device planning_for() names; None outside it."""
    return _PLANNING.get()


def meta_literals_on_cpu(gm: torch.fx.GraphModule) -> None:
    """Rewrite every device=meta that tracing a meta model wrote into gm and its submodules'
    graphs (an arange's device, export's tensor-metadata asserts) to the CPU, where the fakes
    of planning run."""
    meta, cpu = torch.device("meta"), torch.device("cpu")

    def swap(value):
        return cpu if isinstance(value, torch.device) and value == meta else value

    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), swap)
            if (args, kwargs) != (node.args, node.kwargs):
                node.args, node.kwargs = args, kwargs
        module.recompile()


def seen_as(device: torch.device) -> torch.device:
    """The device a tensor on `device` (a torch.device) is as a fake while planning: the CPU for
    the meta device; `device` itself otherwise. Guards compare calls by it."""
    return torch.device("cpu") if device.type == "meta" and planning_device() is not None else device
