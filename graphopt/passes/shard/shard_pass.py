"""shard: each repeated block of the graph becomes an FSDP unit, unit_0 ... unit_{K-1}.

Algorithm:
  1. The blocks: the outermost level of numbered children that repeats (analysis/blocks.py: a
     transformer's layers, a vision model's blocks), each with the graph nodes that run in it.
  2. The rewrite (units.py): each block's run of nodes becomes a submodule, with the recompute
     segments it calls; a parameter several units read (a tied embedding and head) is read by
     the root and passed in; everything outside the blocks stays in the root.
  3. Report each unit's blocks and parameter bytes, the root's, and the parameters passed in;
     with world_size, a rank's predicted peak through the step under FSDP2 (rank_memory.py): the
     device's, where the recompute pass's plan keeps a rank's shards on the host (its step 11).
The result trains as the unsharded graph does; runtime/fsdp.py's fully_shard_units applies
torch's fully_shard to each unit and then to the root, as torchtitan shards a transformer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ...analysis.blocks import outer_blocks
from ...analysis.optimizer_memory import NAMED, check_optimizer
from ...errors import OptionError, UsageError
from ...runtime.fsdp import state_on_host, unit_modules
from ..base import Pass, PassContext, PassResult, count, option, to_bool
from ..options import OptimizeOptions, shard_style
from ..registry import register
from .rank_memory import rank_peak
from .units import make_units

@dataclass(frozen=True)
class ShardOptions:
    """The shard pass's options."""

    shard: str = option("fsdp", shard_style, "how the units are sharded")
    world_size: int | None = option(None, count, "ranks FSDP2 shards over: the report gives a rank's predicted peak")
    optimizer: object = option(None, check_optimizer, "the optimizer whose sharded state a rank's peak covers: "
                                                      "a torch.optim.Optimizer or " + ", ".join(NAMED))
    accumulate: bool = option(False, to_bool, "the step's microbatches add into the sharded gradients: a rank's "
                                              "peak covers them")


@register
class Shard(Pass):
    """Make each repeated block a submodule FSDP can shard on its own (unit_0 ... unit_{K-1})."""

    name = "shard"
    # it rewrites the graph the others planned: they must have run (and planned) first
    runs_after = {name: f"the units split the graph {name} rewrote; {name} plans on the whole graph"
                  for name in ("normalize", "cse", "dce", "fuse", "inplace", "precision", "recompute")}
    makes_units = True
    Options = ShardOptions

    @classmethod
    def from_options(cls, options: OptimizeOptions) -> "Shard":
        """The pass optimize()'s options ask for with shard="fsdp"."""
        return cls.with_settings(ShardOptions(shard=options.shard, world_size=options.world_size,
                                              optimizer=options.optimizer, accumulate=options.accumulate))

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        # Step 1
        if not outer_blocks(list(gm.graph.nodes)):
            raise UsageError(f"shard={self.settings.shard!r}: the model repeats no block (no numbered children such "
                             "as layers.0, layers.1 in its module tree), so there is nothing to make units of: "
                             "shard the whole model with torch's fully_shard, or leave shard out.")
        # Step 2
        runs, passed = make_units(gm)
        # Step 3
        modules = unit_modules(gm)
        inside = {id(p) for unit in modules for p in unit.parameters()}
        stats = {"units": [{"blocks": paths, "parameter_bytes": _bytes(unit.parameters())}
                           for (_, _, paths), unit in zip(runs, modules)],
                 "root_parameter_bytes": _bytes(p for p in gm.parameters() if id(p) not in inside),
                 "passed_to_units": passed}
        peak = None
        if self.settings.world_size and ctx.train:
            rank = rank_peak(gm, ctx.example_args, ctx.example_kwargs, self.settings.world_size, self.settings.optimizer,
                             accumulate=self.settings.accumulate)
            stats.update(world_size=self.settings.world_size, rank_peak_bytes=rank.peak_bytes,
                         rank_breakdown=rank.breakdown, rank_collective_slack_bytes=rank.slack_bytes)
            if state_on_host(gm):  # the recompute pass's step 11: the peak is the device's
                stats["rank_host_bytes"] = rank.host_bytes
            peak = rank.bound_bytes
        return PassResult(gm, True, stats=stats, peak_bytes=peak)


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)
