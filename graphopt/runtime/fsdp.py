"""FSDP2 on the shard pass's units: fully_shard on each unit_k, then on the root, as torchtitan
shards a transformer (its blocks one by one, the root for the embeddings, norm and head).

Where a rank's plan keeps its shards on the host (the recompute pass's step 11), the graph says
so in its meta (state_on_host), and fully_shard_units gives fully_shard FSDP2's CPUOffloadPolicy:
the sharded parameters, their gradients and so the optimizer's state live in host memory, each
unit's shard copied to the device for its all-gathers, its gradients' back after the reduce-scatter.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

from ..errors import UsageError

ON_HOST = "graphopt_shards_on_host"  # the graph's meta key: a rank's plan keeps its shards on the host


def state_on_host(gm: torch.nn.Module) -> bool:
    """Whether gm's plan keeps each rank's sharded parameters, gradients and optimizer state on the host."""
    return bool(getattr(gm, "meta", {}).get(ON_HOST))


def fully_shard_units(gm: torch.fx.GraphModule, *, mesh=None, reshard_after_forward: bool = True, **kwargs):
    """Shard gm (optimize(..., shard="fsdp")'s result) in place and return it. The last unit keeps
    its parameters gathered after its forward, as torchtitan does: its backward comes next.
    kwargs: fully_shard's (mp_policy, offload_policy, ...); where gm's plan keeps the shards on the
    host, offload_policy is CPUOffloadPolicy (pinned where the mesh is a CUDA one)."""
    units = unit_modules(gm)
    if not units:
        raise UsageError("this module has no FSDP units (unit_0, unit_1, ...): build it with "
                         "graphopt.optimize(model, example_inputs, shard='fsdp').")
    if state_on_host(gm):
        policy = kwargs.setdefault("offload_policy", CPUOffloadPolicy(pin_memory=_pinned(mesh)))
        if not isinstance(policy, CPUOffloadPolicy):
            raise UsageError(f"offload_policy={policy!r}, but this graph's plan fits a rank's budget only with its "
                             "sharded parameters, gradients and optimizer state on the host: leave offload_policy "
                             "out (or give CPUOffloadPolicy()), or optimize for a budget a rank holds them in.")
    for k, unit in enumerate(units):
        unit.register_forward_hook(_no_views)  # before fully_shard's own: it sees what this returns
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward and k < len(units) - 1, **kwargs)
    fully_shard(gm, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    return gm


def _pinned(mesh) -> bool:
    """Whether host shards are pinned: where the mesh's device is CUDA (its copies then overlap)."""
    device = mesh.device_type if mesh is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return device == "cuda"


def _no_views(module, args, output):
    """A unit's outputs, each view copied: FSDP2 hooks its backward on the outputs, and an in-place
    op after it on a view (a rewrite's add_ into the residual stream) would drop that hook, and the
    unit's backward would run on parameters it never gathered."""
    if not any(t._is_view() for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)):
        return None
    return pytree.tree_map_only(torch.Tensor, lambda t: t.clone() if t._is_view() else t, output)


def unit_modules(gm: torch.nn.Module) -> list[torch.nn.Module]:
    """unit_0 ... unit_{K-1} (the shard pass's), in the order they run."""
    count = sum(1 for name, _ in gm.named_children() if name.startswith("unit_"))
    return [getattr(gm, f"unit_{k}") for k in range(count)]


def sharded(gm: torch.nn.Module) -> bool:
    """Whether fully_shard_units (or fully_shard on each unit) has sharded gm's units."""
    units = unit_modules(gm)
    return bool(units) and all(isinstance(unit, FSDPModule) for unit in units)
