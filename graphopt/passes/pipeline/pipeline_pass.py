"""pipeline: cut the graph into N balanced stages, stage_0 ... stage_{N-1}.

Algorithm:
  1. Per node, on one microbatch (optimize() traces the model on the first 1/M of the example
     batch and gives the passes that, as torch.distributed.pipelining's own frontend traces a
     microbatch), each fact asked of the analyses: its forward and backward time
     (analysis/cost.py: estimated, or measured with profile=True); the activation bytes it
     keeps for backward (analysis/saved.py); its backward's working set, the most its backward
     holds at once (analysis/memory.py's step on FakeTensors); the parameters it reads, and
     the optimizer's state per parameter byte (analysis/optimizer_memory.py); the bytes
     crossing a cut just before it. A cut is allowed after the graph's inputs, before its
     output, and only where every value crossing it is a contiguous tensor (what a stage
     can send).
  2. Partition (partition.py, an exact dynamic program): the least bottleneck stage cost,
     each device's memory under budget_gb when given (under interleaved-1f1b, each of a
     device's v virtual stages under budget_gb / v), ties broken by fewer bytes crossing the
     cuts. A stage's memory: its parameters, their gradients and optimizer state, the
     activations of the microbatches the schedule keeps in flight on it, its largest
     backward working set, and the receive buffers torch.distributed.pipelining keeps per
     microbatch.
  3. Rewrite (split.py): one submodule per stage, called in a chain; a skip connection is
     passed along through the stages in between; a parameter two stages read (tied weights)
     is read by both: shared in one process, replicated across ranks and its gradients
     summed (runtime/pipeline.py), as torch.distributed.pipelining does.
  4. Report per stage its nodes, cost, parameters, predicted memory and boundary bytes; per
     device its predicted memory; the imbalance (slowest stage over the mean); the
     schedule's predicted bubble; tied parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ...analysis.cost import node_times, step_costs
from ...analysis.effects import CALLS
from ...analysis.memory import as_given, budget_text, estimate_peak, size_text
from ...analysis.meta import TensorInfo, graph_device, tensor_info
from ...analysis.optimizer_memory import NAMED, state_per_byte
from ...analysis.saved import params_read, record_step, storage_key
from ...errors import BudgetError, OptionError
from ...vocabulary.sizes import in_gb
from ..base import Pass, PassContext, PassResult, count, option, plans_memory_after, to_bool
from ..notes import note
from ..options import OptimizeOptions, budget_in_bytes
from ..registry import register
from .partition import SCHEDULES, StageFacts, least_memory, partition
from .split import split_stages

def stage_facts(gm: torch.fx.GraphModule, analysis, optimizer: str = "adam", profile: bool = False) -> StageFacts:
    """Step 1: what the partitioner needs to know about each node of gm, in graph order.
    analysis: PassContext.analysis, which computes each fact once per graph."""
    nodes = list(gm.graph.nodes)
    facts = analysis(record_step, gm)
    kept, live_after = facts.kept_and_live(nodes)
    cost = step_costs(gm, nodes, graph_device(gm), analysis(node_times, gm) if profile else None)
    params = [{key: p.untyped_storage().nbytes() for key, p in params_read(gm, n).items()} for n in nodes]
    last_input = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=-1)
    # A cut before position i is crossed by every value made before i and used at or after i.
    order = {n: i for i, n in enumerate(nodes)}
    bad = [0] * (len(nodes) + 1)
    for n in nodes:
        if n.op == "get_attr" or not n.users:
            continue
        last = max(order[u] for u in n.users)
        if last > order[n] and not _sendable(tensor_info(n)):
            bad[order[n] + 1] += 1
            bad[last + 1] -= 1
    can_cut, running = [], 0
    for i in range(len(nodes)):
        running += bad[i]
        can_cut.append(last_input < i < len(nodes) - 1 and running == 0)
    cross = [0] + live_after[:-1]
    work = analysis(estimate_peak, gm).backward_work
    # a parameter byte's gradient, and the optimizer's state for it
    return StageFacts(cost, kept, params, cross, can_cut, 1 + state_per_byte(optimizer),
                      [work.get(n.name, 0) for n in nodes])


def _sendable(info) -> bool:
    """A value a stage can send as it is: a tensor (gloo and NCCL send tensors), contiguous
    (they send only those, and a copy would change the strides that the receiving stage's views
    of an export graph were recorded for)."""
    return isinstance(info, TensorInfo) and info.contiguous


@dataclass(frozen=True)
class PipelineOptions:
    """The pipeline pass's options."""

    stages: int | None = option(None, count, "number of pipeline stages")
    schedule: str = option("1f1b", str, "pipeline schedule the memory model assumes", SCHEDULES)
    microbatches: int | None = option(None, count, "microbatches per step (default: 2 x stages, at most the batch)")
    budget_bytes: int | None = option(None, budget_in_bytes, "memory cap per device, in GB of 10**9 bytes",
                                      spelled="budget_gb", shown=in_gb)
    ranks: int | None = option(None, count, "devices the stages run on (default: one per stage; interleaved-1f1b: "
                                            "stages / ranks virtual stages each)")
    optimizer: str = option("adam", str, "optimizer whose state each stage holds", tuple(NAMED))
    profile: bool = option(False, to_bool, "cost nodes by their measured time instead of its estimate")


@register
class Pipeline(Pass):
    """Cut the graph into balanced pipeline stages (stage_0 ... stage_{N-1})."""

    name = "pipeline"
    runs_after = plans_memory_after("fuse", "inplace", "precision", "recompute")
    plans_memory = ("values written in place cannot be recomputed from, which can raise the least budget; name it "
                    "in passes= to run it anyway")

    Options = PipelineOptions

    @classmethod
    def from_options(cls, options: OptimizeOptions) -> "Pipeline":
        """The pass optimize()'s options ask for with stages: one device per stage, budget_gb the
        cap of each, profile costing the stages."""
        return cls.with_settings(PipelineOptions(stages=options.stages, budget_bytes=options.budget_bytes,
                                                 profile=options.profile, optimizer=options.optimizer or "adam"))

    def microbatches_of(self, rows: int | None = None) -> int:
        """The microbatch count: as given, else 2 x stages but no more than the batch's rows."""
        if self.settings.microbatches:
            return self.settings.microbatches
        default = 2 * (self.settings.stages or 1)
        return max(1, min(default, rows)) if rows is not None else default

    def _ranks(self, stages: int) -> int | None:
        ranks, schedule = self.settings.ranks, self.settings.schedule
        if schedule != "interleaved-1f1b":
            if ranks not in (None, stages):
                raise OptionError(f"{schedule} runs one stage per device: ranks must equal stages={stages} "
                                  "(or use schedule=interleaved-1f1b).")
            return stages
        if ranks is None:
            if self.settings.budget_bytes:
                raise OptionError("with schedule=interleaved-1f1b, give ranks= (the devices) so that budget_gb "
                                  "caps what each device holds, e.g. pipeline{stages=8 ranks=4 ...}.")
            return None
        if stages % ranks or stages // ranks < 2:
            raise OptionError(f"interleaved-1f1b puts 2 or more stages on each device: stages={stages} must "
                              f"be a multiple of ranks={ranks}, at least twice it.")
        return ranks

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        stages = self.settings.stages
        if stages is None:
            raise OptionError("the pipeline pass needs stages, e.g. pipeline{stages=4}.")
        microbatches = ctx.microbatches  # optimize() derives it once, by microbatches_of
        # Step 1
        facts = stage_facts(gm, ctx.analysis, self.settings.optimizer, self.settings.profile)
        places = sum(facts.can_cut)
        if stages - 1 > places:
            raise OptionError(
                f"stages={stages} needs {stages - 1} cuts, but this graph has {places} places where a "
                f"cut passes only tensors between stages; use stages={places + 1} or fewer.")
        # Step 2
        ranks = self._ranks(stages)
        per_rank = stages // ranks if ranks else 1  # a device's virtual stages each get an equal share
        cap = self.settings.budget_bytes // per_rank if self.settings.budget_bytes else None
        plan = partition(facts, stages, microbatches=microbatches, schedule=self.settings.schedule, memory_cap=cap)
        if plan is None:
            need = least_memory(facts, stages, microbatches=microbatches, schedule=self.settings.schedule)
            balanced = partition(facts, stages, microbatches=microbatches, schedule=self.settings.schedule)
            share = f" ({per_rank} virtual stages per device)" if per_rank > 1 else ""
            raise BudgetError(
                f"no cut into {stages} stages keeps every device under {as_given(self.settings.budget_bytes)}"
                f"{share}: the least any cut needs on its fullest device is {size_text(need * per_rank)} (the "
                f"balanced cut's {size_text(max(balanced.stage_memory) * per_rank)}). Raise budget_gb to "
                f"{budget_text(need * per_rank)} or more, use more "
                "stages or fewer microbatches in flight (schedule=1f1b), or cut activations with precision='bf16'. "
                "The host tier (the optimizer's state, step and gradients on the host) is not planned per stage: "
                "on one device without stages=, budget_gb with optimizer= plans it.",
                min_budget_bytes=need * per_rank,
                breakdown={f"balanced cut, stage {s}": m for s, m in enumerate(balanced.stage_memory)})
        # Step 3
        nodes = list(gm.graph.nodes)
        for s in range(stages):
            for n in nodes[plan.cuts[s]:plan.cuts[s + 1]]:
                note(n, "stage", s)
        staged = split_stages(gm, plan.cuts)
        staged.meta["graphopt_pipeline"] = {"microbatches": microbatches, "schedule": self.settings.schedule,
                                            "ranks": ranks}
        # Step 4
        readers: dict[int, set[int]] = {}
        for s in range(stages):
            for i in range(plan.cuts[s], plan.cuts[s + 1]):
                for key in facts.params[i]:
                    readers.setdefault(key, set()).add(s)
        names = {storage_key(p): name for name, p in gm.named_parameters(remove_duplicate=False)}
        tied = {names.get(key, str(key)): sorted(where) for key, where in readers.items() if len(where) > 1}
        per_stage = []
        for s in range(stages):
            params = {k: v for i in range(plan.cuts[s], plan.cuts[s + 1]) for k, v in facts.params[i].items()}
            per_stage.append({
                "nodes": sum(1 for n in nodes[plan.cuts[s]:plan.cuts[s + 1]] if n.op in CALLS),
                "cost": plan.stage_cost[s], "parameter_bytes": sum(params.values()),
                "predicted_memory_bytes": plan.stage_memory[s],
                "boundary_bytes": plan.boundary_bytes[s] if s < stages - 1 else 0,
            })
        devices = [sum(plan.stage_memory[r::ranks]) for r in range(ranks)] if ranks else None
        return PassResult(staged, True, {
            "stages": per_stage, "predicted_memory_per_rank": devices, "imbalance": round(plan.imbalance, 4),
            "bubble": round(plan.bubble(microbatches), 4), "schedule": self.settings.schedule,
            "microbatches": microbatches, "tied_parameters": tied, "cuts": plan.cuts,
        })
