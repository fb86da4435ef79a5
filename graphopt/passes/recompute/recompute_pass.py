"""recompute: insert recompute checkpoints so one training step fits budget_gb (GB = 10**9 bytes).

Algorithm (where the plan cache holds this graph's plan for these settings, cached.py replays it
instead: the segments, the writes in place and the report's figures, or the refusal):
  1. In training, attribute reads move to the top, and state writes that read no computed
     value move up (tidy.py: they would cut segments). Estimate the step's peak
     (memory.estimate_peak: the step run on FakeTensors, with optimizer= its state and step()
     too; its log prices plans in step 4). A chunked linear head and loss (fuse) takes the
     largest chunk of rows that fits (head_loss_chunks.py). Within budget: nothing more to do,
     and where the step as traced was already within it, a BudgetWarning (a budget in the
     wrong unit?). In inference only the forward runs and recompute cannot help: over budget
     is an error. With cuda_graphs, the target leaves room for what the captured step's graphs
     hold beyond the step (analysis/cuda_graphs.graphs_reserve).
  2. Per node (node_facts.py), from one recorded FakeTensor forward (analysis/saved.py): the
     bytes it keeps for backward, the bytes live across it, whether it may run twice
     (rewrite.recomputable; why not is noted on it for the dumps), what a selective segment
     keeps of it, whether it saves its inputs only or what it makes (a checkpoint's rerun
     stops once the last saving node has saved: solver.rerun_end), and its recompute cost:
     its time, estimated from FLOPs and bytes for the graph's device, or with profile=True
     measured (analysis/cost.py).
  3. Candidate plans (candidates.py): the solver's least recompute cost at activation
     allowances from the least it can meet to none, under two views of the cost, solved from
     the largest allowance down as step 4 needs them, and the plans that recompute each
     repeated block whole, as the model's own checkpointing would; each priced as it runs,
     distinct. The solver's model ranks plans; it is not exact.
  4. The search (search.py). Each candidate is priced from the log of the step as it is
     (pricing.py: where every storage comes and goes, changed as torch.utils.checkpoint
     changes it; about a millisecond a plan, where a fake step of the rewritten graph takes
     seconds). The cheapest that fits by price; the dearest cheaper one over the target,
     grown by a few nodes (candidates.py), may fit for less and take its place; then a plan
     within TIME_RESOLUTION of its cost that reruns fewer matmul FLOPs (candidates.py
     proposes some near it) takes its place. The full estimate of the chosen plan (rewritten
     through torch.utils.checkpoint, rewrite.py, then undone) confirms it; over the target,
     its estimate stands for its price and the search runs again. Where step 6 writes
     anything within the plan, the estimate is of the plan with its writes: within the target
     and the plan's price, it confirms both, and the plan stays written and cut. Cheaper
     plans priced within PRICE_MARGIN over the target get their estimate too, where no
     further over than the prices were off the estimates made so far. When none fits, the
     plan priced lowest is estimated, and up to LOOK_LEAST in all while the next is priced
     within PRICE_MARGIN (and the prices' error so far) of the smallest estimate, and
     BudgetError names the smallest estimated peak (the step as it is included) as the least
     budget that works.
  5. With calibrate=True, rewrite with that plan, run one real step (memory.measure_step,
     model state restored) and, while it measures over budget, plan again for a budget
     lowered by the overshoot (at most CALIBRATIONS times). The plan's segments are cut in
     step 6.
  6. Where the pipeline has the inplace pass (a budget skips it by default), write elementwise
     ops in place within the plan: decided on the graph before its segments are cut, from step
     2's record, by the inplace pass's rules and the plan's (in_place.py: a segment's inputs are
     read again by its rerun), then cut; the estimate is made again (in step 4, as the plan's
     own), and writes that raise it are undone. Also when the budget needs no plan.
  7. Mark every node kept, recomputed or boundary (a segment's inputs), and report: peaks
     before and after, the step's estimated time, recompute FLOPs, time and its share of the
     step, and a picture of predicted memory through the step, before and after
     (kk-recompute.memory.png).
  8. The plan is made for the example's sizes; a call at others (a shorter sequence, a dynamic
     batch) first estimates its step there, once per signature, and raises BudgetError where it
     does not fit (runtime/budget_check.py): a plan for the longest length serves the shorter.
  9. Where no plan fits with everything on the device (keep-or-recompute's least is above the
     target), the host as a tier below it: first step 10 alone, with the optimizer on the device,
     where the parameters and its state leave room for it; kept where it fits and its copies cost
     the step less than the optimizer's step on the host would. Else steps 1 to 8 again with the
     optimizer's state and step on the host (analysis/host_step.py): the device then holds
     neither; where that does not fit either, again with the gradients on the host too, each
     leaving the device as backward makes it; then with step 10 as well; step 10 alone where it
     fits and these do not, or cost more. The plan says which, with the host memory it takes, the time it adds
     and why; optimize() installs the host step on the optimizer (runtime/host_optimizer.py). The
     host step needs an optimizer in the budget; neither runs on one rank's step, stages, CUDA
     graphs, calibrate or optimizer_on_device.
 10. Steps 1 to 8 with every full segment keeping its inputs on the host until its backward
     (runtime/offload.py: the plan's checkpoints off the device, copied back before the segment
     reruns, on CUDA beside the step's kernels), priced as the copies' time the step waits for
     (analysis/offload_time.py: at the host link's measured rate, analysis/cost.Rates.
     host_bytes_per_s, what the compute beside them does not hide).
 11. One rank's step (world_size) where no plan fits: steps 1 to 8 again with the rank's shards on
     the host, as FSDP2's CPUOffloadPolicy keeps them (the sharded parameters, their gradients and
     the optimizer's state: shard/rank_memory.py estimates the device's part). The graph's meta
     says so, and runtime/fsdp.fully_shard_units shards with that policy. Priced as each unit's
     shard copied to the device for its forward's and backward's all-gathers, its gradients'
     back, and the optimizer's step over the shard on the host. Not with optimizer_on_device,
     calibrate or CUDA graphs.
"""
from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import torch
import torch.fx

from ... import ops
from ...analysis.blocks import outer_blocks
from ...analysis.cost import STEP_FORWARDS, forward_costs, node_times, rates
from ...analysis.cuda_graphs import graphs_reserve, input_bytes
from ...analysis.host_step import HostStep, host_step
from ...analysis.memory import (Estimate, below_least, estimate_peak, headroom, held_to, least_holding, measure_step,
                               size_text)
from ...analysis.meta import graph_device
from ...analysis.offload_time import offload_time, offloaded_bytes
from ...analysis.optimizer_memory import NAMED, OptimizerMemory, check_optimizer, optimizer_memory
from ...analysis.saved import record_step
from ...analysis.segments import SegmentCall
from ...analysis.trial import trial_run
from ...errors import BudgetError, BudgetWarning, warn
from ...runtime.budget_check import BudgetCheck
from ...runtime.fsdp import ON_HOST as SHARDS_ON_HOST
from ...vocabulary.sizes import in_gb
from ..base import Pass, PassContext, PassResult, Text, count, option, plans_memory_after, to_bool
from ..fuse.head_loss_chunks import size_chunks
from ..notes import note
from ..options import OptimizeOptions, budget_in_bytes
from ..records import BudgetFit, MemoryCurves, idle_budget
from ..registry import register
from ..shard.rank_memory import RANK_ADVICE, rank_peak, shard_bytes
from .cached import cached_plan
from .candidates import PlanSpace, LinePlans
from .in_place import write_within
from .node_facts import node_facts
from .pricing import PlanPricer
from .rewrite import note_segments
from .search import PlanSearch, graph_snapshot, restore_graph
from .solver import SegmentCost
from .tidy import attributes_first, hoist_state_writes

CALIBRATIONS = 3  # re-plans after a measured step over budget


def _fraction(value) -> float:
    value = float(value) if isinstance(value, (Text, numbers.Real)) and not isinstance(value, bool) else None
    if value is None or not 0 <= value < 0.5:
        raise ValueError("must be in [0, 0.5), e.g. 0.05 for 5%")
    return value


@dataclass(frozen=True)
class RecomputeOptions:
    """The recompute pass's options."""

    budget_bytes: int | None = option(None, budget_in_bytes, "peak memory of one training step, in GB of 10**9 bytes",
                                      spelled="budget_gb", shown=in_gb)
    headroom: float | None = option(None, _fraction, "fraction of the budget kept free for what the estimate "
                                    "cannot see, in [0, 0.5); default the device's (analysis/memory.headroom)")
    profile: bool = option(False, to_bool, "cost recompute by each node's measured time instead of its estimate")
    calibrate: bool = option(False, to_bool, "measure one real step and plan again while it is over budget")
    optimizer: object = option(None, check_optimizer, "the optimizer whose state and step() the budget covers: "
                                                      "a torch.optim.Optimizer or " + ", ".join(NAMED))
    accumulate: bool = option(False, to_bool, "the step runs with every .grad present, backward adding into it "
                                              "(gradient accumulation): the budget covers them from the start")
    world_size: int | None = option(None, count, "ranks FSDP2 shards the step over (shard='fsdp'): budget_gb is "
                                                 "then one rank's")
    optimizer_on_device: bool = option(False, to_bool, "keep the optimizer's state and step, and the checkpoints, "
                                                       "on the device (no steps 9 and 10): where no plan fits, refuse")
    prefetch: int | None = option(None, count, "batches graphopt.prefetch holds on the device ahead of the step, "
                                               "each of the example's size: the step is planned for that much less")


@register
class Recompute(Pass):
    """Recompute the cheapest activations in backward so a training step fits budget_gb."""

    name = "recompute"
    runs_after = plans_memory_after("fuse", "inplace", "precision")
    plans_memory = ("the recompute pass writes in place within its plan, as the inplace pass would but for the "
                    "values its segments recompute from")
    Options = RecomputeOptions

    @classmethod
    def from_options(cls, options: OptimizeOptions) -> "Recompute":
        """The pass optimize()'s options ask for with budget_gb (and no stages)."""
        return cls.with_settings(RecomputeOptions(
            budget_bytes=options.budget_bytes, profile=options.profile, calibrate=options.calibrate,
            optimizer=options.optimizer, accumulate=options.accumulate, world_size=options.world_size,
            optimizer_on_device=options.optimizer_on_device, prefetch=options.prefetch))

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        """The plan from the plan cache where an entry made for this graph and these settings is
        there (cached.py), else planned (and kept there)."""
        self.host = None  # the optimizer's step on the host, where the plan chose it
        self.offload = False  # the segments' inputs on the host (step 10)
        self.rank_host = False  # a rank's shards on the host (step 11)
        return cached_plan(self, gm, ctx, self._plan)

    def setup(self, gm: torch.fx.GraphModule, ctx: PassContext, optimizer: OptimizerMemory | None = None
              ) -> tuple[int, int]:
        """The budget in bytes and the target the step is planned for (less the headroom and what
        CUDA graphs hold); the optimizer's memory (measured, unless given: the plan cache's),
        accumulation and headroom kept on the pass."""
        limit = self.settings.budget_bytes
        if limit is None:
            raise BudgetError("the recompute pass needs budget_gb, e.g. recompute{budget_gb=8}.")
        self.headroom = self.settings.headroom
        if self.headroom is None:
            self.headroom = headroom(graph_device(gm))
        if optimizer is None and self.settings.optimizer is not None and ctx.train and self.host is None:
            optimizer = optimizer_memory(self.settings.optimizer, list(gm.parameters()))
        self.optimizer = optimizer
        # a step captured as CUDA graphs holds more than the step itself: planned for that much less
        self.reserve = graphs_reserve(gm, ctx.flat_inputs(gm), self.optimizer) if ctx.cuda_graphs and ctx.train else 0
        # and the batches a prefetch holds ahead of the step (runtime/prefetch.py), each the example's size
        self.prefetched = (self.settings.prefetch or 0) * input_bytes(ctx.flat_inputs(gm))
        self.reserve += self.prefetched
        self.accumulate = self.settings.accumulate and ctx.train
        return limit, held_to(limit, self.headroom) - self.reserve

    def _plan(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        """Steps 1 to 8 with the optimizer on the device; where no plan fits, again with its state
        and step on the host (step 9). The result says what the step costs by the time model."""
        device = "cuda" if graph_device(gm) == "cuda" else "cpu"
        calls = [n for n in gm.graph.nodes if n.op.startswith("call")]
        step_s = STEP_FORWARDS * sum(forward_costs(gm, calls, device)) / 1e9
        try:
            result = self._plan_on_device(gm, ctx)
        except BudgetError as refused:
            if self._may_shard_to_host(ctx):
                result = self._plan_rank_on_host(gm, ctx, refused.min_budget_bytes, device, step_s)
            elif self._may_offload(ctx):
                result = self._plan_on_host(gm, ctx, refused, device, step_s)
            else:
                raise
        if ctx.train:
            result.stats["step_ms"] = round(step_s * 1e3, 3)
        if self.prefetched:
            result.stats["prefetched_bytes"] = self.prefetched
        return result

    def _plan_on_host(self, gm: torch.fx.GraphModule, ctx: PassContext, refused: BudgetError, device: str,
                      step_s: float) -> PassResult:
        """Steps 9 and 10, the fitting plan whose step costs least: the segments' inputs on the host
        with the optimizer on the device (step 10 alone) where their copies cost less than the host's
        step would; else the optimizer's state and step on the host; then its gradients too; then the
        segments' inputs as well; step 10 alone where it fits and these do not, or cost more.
        refused: the refusal with all of it on the device; step_s: the step's seconds there. Where
        none fits, the refusal that names the least budget of them all."""
        memory = self.optimizer  # the device's plans measured it; with the step on the host, setup leaves it out
        least, refusals = refused.min_budget_bytes, [refused]
        stepping = self._may_step_on_host(ctx)
        unplanned = graph_snapshot(gm)  # each way down plans from the graph as it came
        alone = self._plan_offloaded(gm, ctx, device, refusals)
        hosted = host_step(gm.parameters(), memory, device) if stepping else None
        if alone is not None and (hosted is None or alone[1] <= hosted.seconds):
            return self._offloaded(alone[0], gm, device, least, hosted)
        planned = graph_snapshot(gm) if alone is not None else None
        result = None
        for gradients, offload in ((False, False), (True, False), (True, True)) if stepping else ():
            restore_graph(gm, graph_snapshot(unplanned, gm), None)
            self.host, self.offload = host_step(gm.parameters(), memory, device, gradients), offload
            try:
                result = self._plan_on_device(gm, ctx)
                break
            except BudgetError as e:
                refusals.append(e)
        if result is not None and self.host.gradients:  # their copies down as the planned backward hides them
            copies = offload_time(gm, device, gradients=True)
            self.host = self.host.overlapped(copies.gradients_waited_s)
            if self.offload and alone is not None and self.host.seconds + copies.waited_s > alone[1]:
                result = None  # everything on the host costs more than step 10 alone
        if result is None and alone is None:
            # step 10 alone, not searched at this budget, may still need less than the others
            if self._resident_least(gm, memory) < min(e.min_budget_bytes for e in refusals):
                restore_graph(gm, graph_snapshot(unplanned, gm), None)
                self._plan_offloaded(gm, ctx, device, refusals, at_least=True)
            raise min(refusals, key=lambda e: e.min_budget_bytes)
        if result is None:  # the segments' inputs alone, the cheapest that fits: their plan again
            restore_graph(gm, planned, None)
            self.host, self.offload, self.optimizer = None, True, alone[2]
            return self._offloaded(alone[0], gm, device, least, hosted)
        self.cacheable = False  # the plan cache keeps plans of the step on the device only
        result.host_step = self.host
        result.stats.update({"host_step": f"on the device the least plan needs {size_text(least)}",
                             "host_step_ms": round(self.host.seconds * 1e3, 1),
                             "host_step_overhead_pct": round(100 * self.host.seconds / max(step_s, 1e-12), 1)})
        if alone is not None:
            result.stats["host_step"] += (f"; the segments' inputs alone on the host cost {alone[1] * 1e3:.3g} ms a "
                                          "step in copies, more than the host's step")
        return self._offloaded(result, gm, device) if self.offload else result

    def _plan_offloaded(self, gm: torch.fx.GraphModule, ctx: PassContext, device: str, refusals: list,
                        at_least: bool = False) -> tuple[PassResult, float, OptimizerMemory | None] | None:
        """Step 10 alone: the plan with every full segment's inputs on the host and the optimizer on the
        device, its copies' seconds a step and the optimizer's memory it planned with; None where it
        does not fit (its refusal added to refusals). Not searched where the parameters and the
        optimizer's state alone are over the budget, unless at_least (for the least its refusal names)."""
        self.host, self.offload = None, True
        if not at_least and self._resident_least(gm, self.optimizer) > self.settings.budget_bytes:
            return None
        try:
            result = self._plan_on_device(gm, ctx)
        except BudgetError as e:
            refusals.append(e)
            return None
        return result, offload_time(gm, device).waited_s, self.optimizer

    def _resident_least(self, gm: torch.fx.GraphModule, optimizer: OptimizerMemory | None) -> int:
        """A budget below which no plan with the optimizer (its memory) on the device fits, known without
        planning: the one that holds the parameters and the optimizer's state, as the estimate counts them."""
        state = optimizer.state_bytes if optimizer is not None else 0
        return least_holding(sum(p.numel() * p.element_size() for p in gm.parameters()) + state + self.reserve,
                             self.headroom)

    def _offloaded(self, result: PassResult, gm: torch.fx.GraphModule, device: str, least: int | None = None,
                   hosted: HostStep | None = None) -> PassResult:
        """result with what its offloaded segments move and cost a step; least and hosted, where they
        are the plan's only way down: why it chose them (the device's least, the host step's time)."""
        self.cacheable = False
        copies = offload_time(gm, device)
        result.stats.update({"offloaded_segments": sum(isinstance(n.target, SegmentCall) and n.target.offloaded
                                                       for n in gm.graph.nodes),
                             "offloaded_bytes": offloaded_bytes(gm),
                             "offload_copies_ms": round(copies.copies_s * 1e3, 3),
                             "offload_ms": round(copies.waited_s * 1e3, 3)})
        if least is not None:
            why = f"on the device the least plan needs {size_text(least)}"
            if hosted is not None:
                why += f"; the copies cost a step less than the optimizer's on the host ({hosted.seconds * 1e3:.3g} ms)"
            result.stats["offload"] = why
        return result

    def _plan_rank_on_host(self, gm: torch.fx.GraphModule, ctx: PassContext, least: int, device: str,
                           step_s: float) -> PassResult:
        """Step 11: a rank's plan with its shards on the host. least: what a rank's device needs with
        them on it; step_s: the step's seconds on the device."""
        self.rank_host = True
        result = self._plan_on_device(gm, ctx)
        gm.meta[SHARDS_ON_HOST] = True
        shard, r = shard_bytes(gm.parameters(), self.settings.world_size), rates(device)
        # the shard down for the forward's all-gathers and the backward's, the gradients' shard up
        copies = 3 * shard / r.host_bytes_per_s
        stepped = shard / r.host_step_bytes_per_s
        result.stats.update({"rank_shards_on_host": f"FSDP2's CPUOffloadPolicy: on the device a rank's least plan "
                                                    f"needs {size_text(least)}",
                             "rank_host_copy_ms": round(copies * 1e3, 3), "rank_host_step_ms": round(stepped * 1e3, 3),
                             "rank_host_overhead_pct": round(100 * (copies + stepped) / max(step_s, 1e-12), 1)})
        return result

    def _may_shard_to_host(self, ctx: PassContext) -> bool:
        """Whether step 11 may run: one rank's training step, not held on the device by the user
        (optimizer_on_device), nor calibrated by real steps, nor captured as CUDA graphs."""
        return (bool(self.settings.world_size) and ctx.train and not self.settings.optimizer_on_device
                and not self.settings.calibrate and not ctx.cuda_graphs)

    @property
    def host_gradients(self) -> bool:
        """The plan takes each gradient off the device as backward makes it (step 9's second form)."""
        return self.host is not None and self.host.gradients

    def _may_offload(self, ctx: PassContext) -> bool:
        """Whether step 10 may run: a training step on one device (not one rank's under FSDP2, whose
        shards step 11 moves, nor stages), neither captured as CUDA graphs (the copies would be in
        the capture) nor calibrated by real steps, and the host tier not declined (optimizer_on_device)."""
        return (ctx.train and not self.settings.world_size and not self.settings.calibrate
                and not self.settings.optimizer_on_device and not ctx.staged and not ctx.cuda_graphs)

    def _may_step_on_host(self, ctx: PassContext) -> bool:
        """Whether step 9 may run: where step 10 may, with an optimizer in the budget that has memory
        of its own (a step captured as CUDA graphs has its optimizer step in the capture, and one
        calibrated by real steps runs no optimizer)."""
        o = self.optimizer
        return o is not None and o.state_bytes + o.step_bytes > 0 and self._may_offload(ctx)

    def _plan_on_device(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        # what the plan cache keeps of this plan: (the plan, each node's decision) and the nodes it indexes
        self.chosen, self.planned_nodes, self.cacheable = None, None, True
        limit, target = self.setup(gm, ctx)
        # Step 1 (with step 2's tidying first, so that one estimate serves the search too)
        tidied = ctx.train and bool(attributes_first(gm) + hoist_state_writes(gm))
        if tidied:
            gm.recompile()
        before = ctx.analysis(estimate_peak, gm, train=ctx.train, optimizer=self.optimizer, accumulate=self.accumulate,
                              host_gradients=self.host_gradients)
        if self.host is None:
            self.peak_on_device = before.peak_bytes  # the step as traced, the optimizer on the device
        stats = {}  # the budget, its target and the peaks are the result's BudgetFit
        fit = functools.partial(BudgetFit, limit, target, self.peak_on_device)
        # Per rank (world_size): the search plans one device's step, for the target that puts a rank's at
        # it; calls at other sizes are held to that target too (the call check)
        ranks = self.settings.world_size if ctx.train else None
        if self.reserve:
            stats["cuda_graphs_reserve_bytes"] = self.reserve
        if ranks:
            rank_before = self._rank_peak(gm, ctx)
            fit = functools.partial(BudgetFit, limit, target, rank_before)
            stats["world_size"] = ranks
            target += before.peak_bytes - rank_before  # one device's step over a rank's, unplanned
        if not ctx.train:
            if before.peak_bytes > target:
                raise self._error(before.peak_bytes, before.breakdown, inference=True)
            self._warn_idle(fit(before.peak_bytes))
            return PassResult(gm, False, stats, call_checks=[self.budget_check(target, ctx)],
                              budget=fit(before.peak_bytes), peak_bytes=before.peak_bytes)
        chunk = size_chunks(gm, lambda g: self._estimate(g, ctx).peak_bytes, target)
        if chunk is not None:
            self.cacheable = False  # the chunked head's rows are not replayed from the cache
            stats["loss_chunk_rows"] = chunk
            before = ctx.analysis(estimate_peak, gm, train=ctx.train, optimizer=self.optimizer,
                                  accumulate=self.accumulate, host_gradients=self.host_gradients)
        if before.peak_bytes <= target:
            self._warn_idle(fit(rank_before if ranks else before.peak_bytes))
            written, before = self._write_in_place(gm, ctx, None, None, before)
            peak = before.peak_bytes if not ranks else self._rank_peak(gm, ctx) if written else rank_before
            return PassResult(gm, tidied or chunk is not None or bool(written),
                              {**stats, "segments": 0, "written_in_place": written},
                              memory=MemoryCurves({"as traced": before}, limit),
                              call_checks=[self.budget_check(target, ctx)], budget=fit(peak), peak_bytes=peak)
        # Step 2
        step = ctx.analysis(record_step, gm)
        facts = node_facts(gm, step)
        nodes = self.planned_nodes = facts.nodes  # the search keeps this list on the graph's nodes
        device = "cuda" if graph_device(gm) == "cuda" else "cpu"
        cost = forward_costs(gm, nodes, device, ctx.analysis(node_times, gm) if self.settings.profile else None)
        flops = [ops.flops(n, gm) if n.op.startswith("call") else 0 for n in nodes]
        r = rates(device)
        # gradients that leave the device as backward makes them are not there when later backwards run
        grads = [0] * len(nodes) if self.host_gradients else facts.grads
        space = PlanSpace(nodes, facts.ok, kept=facts.kept, live_after=facts.live_after, grads=grads, cost=cost,
                          saves=facts.saves, sel=facts.sel, ops=facts.ops, flops=flops,
                          segment_cost=SegmentCost(round(r.segment_s * 1e9), round(r.policy_op_s * 1e9)),
                          barriers=_block_bounds(nodes) if ctx.units else ())
        for n, why in zip(nodes, facts.why_not):
            if why is not None and n.op.startswith("call"):
                note(n, "cannot_rerun", why)
        # Step 3
        pricer = PlanPricer(before.log, step, nodes, facts.saves)
        search = PlanSearch(gm, space, sorted(space.blocks, key=lambda p: (p.recompute_cost, p.predicted_peak)),
                            lambda: self._estimate(gm, ctx), pricer, LinePlans(space))
        search.offload = self.offload
        if not self.settings.calibrate and not ranks:  # both measure the plan without the writes first
            search.finish = lambda plan: self._written(gm, ctx, search, plan)
        # Steps 4 and 5
        plan, after = self._fit_rank(gm, ctx, search, target, rank_before) if ranks else search.cheapest_within(target)
        if plan is None:  # without a plan at all, nothing may be recomputed: the step as it is is the least
            least = min((e for e in (after, before) if e is not None), key=lambda e: e.peak_bytes)
            raise self._error(least.peak_bytes, least.breakdown, inference=False)
        if self.settings.calibrate:
            search.rewrite(plan)
            for round_ in range(1, CALIBRATIONS + 1):
                measured = _measure(gm, ctx, self.accumulate)
                stats.update(measured_peak_bytes=measured, calibration_rounds=round_)
                if measured <= limit:
                    break
                target -= measured - limit
                search.undo()
                plan, after = search.cheapest_within(target)
                if plan is None:
                    raise self._error(after.peak_bytes + measured - limit, after.breakdown,
                                      inference=False, measured=True)
                search.rewrite(plan)
            else:
                stats["measured_peak_bytes"] = _measure(gm, ctx, self.accumulate)
                if stats["measured_peak_bytes"] > limit:
                    raise self._error(stats["measured_peak_bytes"], after.breakdown,
                                      inference=False, measured=True)
            search.undo()
        # Step 6, and the plan's segments cut, where the search did not do both
        if search.finished is not None:
            written, after = search.finished
        else:
            written, after = self._write_in_place(gm, ctx, search, plan, after,
                                                  search.with_writes.get(tuple(plan.segments)))
        # Step 7
        note_segments(gm)
        self.chosen = plan, [search.decision.get(n, "kept") for n in nodes]
        recomputed = [i for i, n in enumerate(nodes) if search.decision.get(n) == "recomputed"]
        stats.update({
            "segments": len(plan.segments),
            "selective_segments": sum(s.selective for s in plan.segments),
            "recomputed_nodes": len(recomputed),
            "recompute_flops": sum(flops[i] for i in recomputed),
            "recompute_overhead_pct": round(100 * plan.recompute_cost / max(STEP_FORWARDS * sum(cost), 1), 1),
            "cost_by": "measured time" if self.settings.profile else f"estimated time ({device})",
            "recompute_ms": round(plan.recompute_cost / 1e6, 3),
            "written_in_place": written,
        })
        peak = after.peak_bytes
        if ranks:
            peak = self._rank_peak(gm, ctx)
            # step 6 keeps its writes where they lower one device's step: a rank's is estimated again
            if peak > held_to(limit, self.headroom):
                raise self._error(peak, {}, inference=False)
        return PassResult(gm, True, stats, memory=MemoryCurves({"as traced": before, "with recompute": after}, limit),
                          call_checks=[self.budget_check(target, ctx)], budget=fit(peak), peak_bytes=peak)

    def _warn_idle(self, fit: BudgetFit) -> None:
        """BudgetWarning where the step as traced fits the budget: a budget that asks for nothing is
        most often one in the wrong unit. Not of a step fitting with the optimizer on the host, which
        did not fit with it on the device."""
        idle = idle_budget(fit) if self.host is None else None
        if idle:
            warn(idle, BudgetWarning)

    def _rank_peak(self, gm: torch.fx.GraphModule, ctx: PassContext) -> int:
        """What a rank's step under FSDP2 may hold at most, by the estimate: its peak and what a
        collective may still hold (shard/rank_memory.py), its shards on the host where step 11 put them."""
        return rank_peak(gm, ctx.example_args, ctx.example_kwargs, self.settings.world_size,
                         self.settings.optimizer, accumulate=self.accumulate, host=self.rank_host).bound_bytes

    def _fit_rank(self, gm, ctx: PassContext, search: PlanSearch, target: int, unplanned: int):
        """Steps 4 and 5 for a rank's budget (world_size): the search's plan for the one-device target,
        estimated as a rank's step; while over, the search again for a target lowered by the
        overshoot from that plan's own one-device peak (its shift is its own: recompute's reruns
        run while a unit is gathered). Where the search finds none, the plan it estimated least
        may still fit a rank; else it names the least: that plan's or the unplanned step's
        (`unplanned`, a rank's bytes), whichever is less: the plan one device's step needs least of
        is not always a rank's least."""
        limit = held_to(self.settings.budget_bytes, self.headroom)
        for _ in range(CALIBRATIONS):
            plan, after = search.cheapest_within(target)
            least = plan is None
            if least:
                if not search.estimates:
                    raise self._error(unplanned, {}, inference=False)
                k = min(search.estimates, key=lambda i: search.estimates[i].peak_bytes)
                plan, after = search.candidates[k], search.estimates[k]
            search.rewrite(plan)
            peak = self._rank_peak(gm, ctx)
            search.undo()
            if peak <= limit:
                return plan, after
            if least:  # a rank's breakdown is not the one-device step's: none given
                raise self._error(min(peak, unplanned), {}, inference=False)
            target = after.peak_bytes - (peak - limit)
        raise self._error(min(peak, unplanned), {}, inference=False)

    def _estimate(self, gm: torch.fx.GraphModule, ctx: PassContext) -> Estimate:
        """The fake step of gm as it is now, with the optimizer and accumulation this plan is for."""
        return estimate_peak(gm, ctx.flat_inputs(gm), optimizer=self.optimizer, accumulate=self.accumulate,
                             host_gradients=self.host_gradients)

    def budget_check(self, target: int, ctx: PassContext) -> BudgetCheck:
        """The plan fits the budget at the example's sizes; other sizes run correctly but could
        exceed it, so a call at them is estimated first (runtime/budget_check.py)."""
        return BudgetCheck(self.settings.budget_bytes, target, ctx.train, self.optimizer, self.accumulate,
                           (ctx.example_args, ctx.example_kwargs), self.host_gradients)

    def _write_in_place(self, gm: torch.fx.GraphModule, ctx: PassContext, search: PlanSearch | None, plan,
                        estimate: Estimate, known: Estimate | None = None) -> tuple[dict, Estimate]:
        """Step 6, on gm before its segments are cut, which it then cuts: the ops written in
        place within the plan, by name, and the step's estimate. Measured, not assumed: where the
        writes raise the estimate, the graph goes back to the plan without them. known: the
        estimate of the plan with its writes, where the search made it already."""
        if known is not None and known.peak_bytes > estimate.peak_bytes:
            self._cut(gm, search, plan)
            return {}, estimate
        found = self._written(gm, ctx, search, plan, known)
        if found is not None:
            written, after, before = found
            if after.peak_bytes <= estimate.peak_bytes:
                return written, after
            restore_graph(gm, before, search)
        self._cut(gm, search, plan)
        return {}, estimate

    def _written(self, gm: torch.fx.GraphModule, ctx: PassContext, search: PlanSearch | None, plan,
                 known: Estimate | None = None) -> tuple[dict, Estimate, torch.fx.Graph] | None:
        """Where the pipeline has the inplace pass (which a budget skips by default) and its rules
        and the plan's allow a write (in_place.py): the writes, by name, made in gm with the plan's
        segments cut, the step's estimate and gm's graph as it was (for restore_graph); None, gm
        untouched, where no write is allowed. known: that estimate, made before on the same graph."""
        if not ctx.writes_in_place:
            return None
        before = graph_snapshot(gm)
        nodes = list(gm.graph.nodes)
        sel = search.sel if search is not None else [0] * len(nodes)
        # the step's record before any plan (step 2's): the graph is that one, node by node
        written, _ = write_within(gm, nodes, plan, ctx.analysis(record_step, gm), sel)
        if not written:
            return None
        # No FakeTensor run for the writes: each keeps the metadata of the node it replaced, and the
        # segments' check (rewrite._writes_inside) asks whether a tensor shares storage with its own
        # inputs, which a write into one of them does not change.
        self._cut(gm, search, plan)
        if known is None:
            known = self._estimate(gm, ctx)
        return written, known, before

    @staticmethod
    def _cut(gm: torch.fx.GraphModule, search: PlanSearch | None, plan) -> None:
        """The plan's segments cut in gm's graph as it now is."""
        if search is not None:
            search.nodes[:] = list(gm.graph.nodes)  # each write replaced its node where it stood
            search.rewrite(plan)

    def _error(self, minimum: int, breakdown: dict, inference: bool,
               measured: bool = False) -> BudgetError:
        minimum = least_holding(minimum + self.reserve, self.headroom)
        what = "the forward pass (inference: nothing to recompute)" if inference else "one training step"
        ranks = self.settings.world_size
        if ranks and not inference:
            hosted = " with its shards on the host (FSDP2's CPUOffloadPolicy)" if self.rank_host else ""
            return below_least(self.settings.budget_bytes, minimum,
                               f"one rank's training step under FSDP2 over {ranks} ranks{hosted} needs at "
                               f"least, {'as measured' if measured else 'by the estimate'}", breakdown, RANK_ADVICE,
                               self.headroom)
        how = "as measured" if measured else "by the estimate"
        if self.host is not None:
            what += f" with the optimizer's {self.host.moved} on the host"
            what += " and the recompute segments' inputs too" if self.offload else ""
        elif self.offload:
            what += " with the recompute segments' inputs on the host"
        # microbatches shrink a training step's activations; train_step's own refusal words its advice itself
        batch = "" if inference else (" run the step as microbatches with graphopt.train_step (the fewest that "
                                      "fit the budget, gradients accumulated),")
        if not inference and self.settings.optimizer is None:  # the host tier needs the optimizer (step 9)
            batch += (" give optimizer= (the one you step: the plan may then keep its state, step and gradients "
                      "on the host, and the checkpoints too),")
        return below_least(self.settings.budget_bytes, minimum, f"{what} needs at least, {how}", breakdown,
                           f"halve activations with precision='bf16',{batch} or split the model over devices with "
                           "stages=N", self.headroom)


def _block_bounds(nodes: list[torch.fx.Node]) -> tuple[int, ...]:
    """Where each repeated block starts and ends: the shard pass makes each a unit of its own,
    which a segment must not run across (it would join two blocks' parameters in one unit)."""
    return tuple(sorted({k for at in outer_blocks(nodes).values() for k in (min(at), max(at) + 1)}))


def _measure(gm: torch.fx.GraphModule, ctx: PassContext, accumulate: bool) -> int:
    """Measured peak of one real training step; the model's buffers, gradients and RNG as before."""
    with trial_run(gm, (ctx.example_args, ctx.example_kwargs)):
        return measure_step(gm, ctx.example_args, ctx.example_kwargs, accumulate=accumulate)



