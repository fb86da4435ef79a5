"""FSDP2 on the shard pass's units: fully_shard on each unit_k, then on the root, as torchtitan
shards a transformer (its blocks one by one, the root for the embeddings, norm and head)."""
from __future__ import annotations

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..errors import UsageError


def fully_shard_units(gm: torch.fx.GraphModule, *, mesh=None, reshard_after_forward: bool = True, **kwargs):
    """Shard gm (optimize(..., shard="fsdp")'s result) in place and return it. The last unit keeps
    its parameters gathered after its forward, as torchtitan does: its backward comes next.
    kwargs: fully_shard's (mp_policy, offload_policy, ...)."""
    units = unit_modules(gm)
    if not units:
        raise UsageError("this module has no FSDP units (unit_0, unit_1, ...): build it with "
                         "graphopt.optimize(model, example_inputs, shard='fsdp').")
    for k, unit in enumerate(units):
        unit.register_forward_hook(_no_views)  # before fully_shard's own: it sees what this returns
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward and k < len(units) - 1, **kwargs)
    fully_shard(gm, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    return gm


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
