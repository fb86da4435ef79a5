"""recompute: insert recompute checkpoints so one training step fits budget_gb (GB = 10**9 bytes).

Algorithm:
  1. In training, attribute reads move to the top, and state writes that read no computed
     value move up (they would cut segments). Estimate the step's peak (memory.estimate_peak:
     the step run on FakeTensors, with optimizer= its state and step() too; its log prices
     plans in step 4). A chunked linear head and loss (fuse) takes
     the largest chunk of rows that fits (_size_chunks). Within budget: nothing more to do,
     and where the step as traced was already within it, a BudgetWarning (a budget in the wrong unit?).
     In inference only the forward runs and recompute cannot help: over budget is an error.
  2. Per node, from one recorded FakeTensor forward (analysis/saved.py): the bytes it keeps for backward, the
     bytes live across it, whether it may run twice (rewrite.recomputable), what a
     selective segment keeps of it, whether it saves its inputs only or what it makes (a
     checkpoint's rerun stops once the last saving node has saved: solver.rerun_end), and its
     recompute cost: its time, estimated from FLOPs and bytes for the graph's device, or with
     profile=True measured (analysis/cost.py).
  3. Candidate plans (candidates.py): the solver's least recompute cost at activation
     allowances from the least it can meet to none, under two views of the cost, solved from
     the largest allowance down as step 4 needs them, and the plans that recompute each
     repeated block whole, as the model's own checkpointing would; each priced as it runs,
     distinct. The solver's model ranks plans; it is not exact.
  4. Each candidate is priced from the log of the step as it is (pricing.py: where every
     storage comes and goes, changed as torch.utils.checkpoint changes it; about a
     millisecond a plan, where a fake step of the rewritten graph takes seconds). The
     cheapest that fits by price; the dearest cheaper one over the target, grown by a few
     nodes (candidates.py), may fit for less and take its place; then a plan within
     TIME_RESOLUTION of its cost that reruns fewer matmul FLOPs (candidates.py proposes some
     near it) takes its place. The full estimate of the chosen plan (rewritten through
     torch.utils.checkpoint, rewrite.py, then undone) confirms it; over the target, its
     estimate stands for its price and the search runs again. Where step 6 writes anything
     within the plan, the estimate is of the plan with its writes: within the target and the
     plan's price, it confirms both, and the plan stays written and cut. Cheaper plans priced
     within PRICE_MARGIN over the target get their estimate too, where no further over than
     the prices were off the estimates made so far. When none fits, the plan priced lowest is
     estimated, and up to LOOK_LEAST in all while the next is priced within PRICE_MARGIN (and
     the prices' error so far) of the smallest estimate, and BudgetError names the smallest
     estimated peak (the step as it is included) as the least budget that works.
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
     before and after, recompute FLOPs, time and its share of the step, and a picture of
     predicted memory through the step, before and after (kk-recompute.memory.png).
  8. The plan is made for the example's sizes; a call at others (a shorter sequence, a dynamic
     batch) first estimates its step there, once per signature, and raises BudgetError where it
     does not fit (runtime/budget_check.py): a plan for the longest length serves the shorter.
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.fx

from ... import ops
from ...analysis.cost import STEP_FORWARDS, forward_costs, node_times, rates
from ...analysis.memory import GB, Estimate, budget_bytes, budget_text, estimate_peak, measure_step, size_text
from ...analysis.meta import graph_device, tensor_info
from ...analysis.optimizer_memory import NAMED, check_optimizer, optimizer_memory
from ...analysis.saved import params_read, record_step
from ...analysis.segments import SegmentCall
from ...dump import note
from ...errors import BudgetError, BudgetWarning, warn
from ...plot import memory_csv, memory_png
from ...report import idle_budget
from ...runtime.budget_check import BudgetCheck
from ...runtime.chunked_loss import ChunkedHeadLoss, chunk_rows
from ...trial import trial_run
from ..base import Option, Pass, PassContext, PassResult, Text, plans_memory_after, positive, to_bool
from ..registry import register
from .candidates import PlanSpace, Scan
from .in_place import write_within
from .pricing import PlanPricer
from .rewrite import checkpoint_segments, inline_segments, recomputable
from .solver import SegmentCost, rerun_end

# Costs this close are a tie, which the plan rerunning fewer matmul FLOPs (work that grows with
# the model's width, and a GPU's largest) wins, unless it is the dearer and cuts more segments: a
# segment's own cost (its hooks, its rerun's dispatch) is what the time model knows least. On this
# project's CPU: Llama's plan with 15% fewer matmul FLOPs, 9% dearer, steps 13% slower; Phi's
# with 4 segments for the cheapest's 2, 4% dearer, 5% slower. A leaner plan that is also the
# cheaper wins whatever its segments (DenseNet-121's, when selective segments were priced per
# graph node: 22 segments for 7, no convolution rerun).
TIME_RESOLUTION = 0.05
LOOK_GROWN = 8    # grown plans priced against the budget
# Pricing is a model (pricing.py): a cheaper plan priced at most this far over the target
# gets a fake step of its own (up to LOOK_NEAR), and when none fits, so do plans priced within
# it of the smallest estimate (up to LOOK_LEAST in all).
PRICE_MARGIN = 0.01
LOOK_NEAR = 4
LOOK_LEAST = 3
# Plans a line solves at larger allowances keep more: when its lowest are priced this far over
# the target, the search looks for the least only (the corpus's prices rise along each line
# by a few percent an allowance, and fall back by less).
REACH = 0.1
CALIBRATIONS = 3  # re-plans after a measured step over budget
# On CPU the estimate counts what a measured step counts, storage by storage. On CUDA the
# allocator also holds what no tensor shows: cuBLAS and cuDNN workspaces, its rounding.
CUDA_HEADROOM = 0.05


def _size_chunks(gm: torch.fx.GraphModule, ctx: PassContext, target: int, optimizer, accumulate: bool) -> int | None:
    """Rows per chunk of every chunked linear head and loss (fuse), the same for all: the largest
    power of two, up to the whole batch, whose step the estimate puts within target, and at
    least Liger's (chunk_rows: a chunk's logits about the size of the head's input), which stays
    when none fits and recompute has to make room. Larger chunks run fewer, larger matmuls.
    None when the graph has none."""
    heads = [n for n in gm.graph.nodes if isinstance(n.target, ChunkedHeadLoss)]
    if not heads:
        return None
    h, weight = tensor_info(heads[0].args[0]), tensor_info(heads[0].args[1])
    rows = math.prod(h.shape[:-1])
    least = chunk_rows(rows, weight.shape[0], h.shape[-1])
    sizes = [1 << k for k in range(max(rows - 1, 0).bit_length(), -1, -1) if 1 << k >= least] or [least]
    for size in sizes:
        for n in heads:
            n.target = n.target.sized(min(size, rows))
        gm.recompile()
        if size == sizes[-1] or estimate_peak(gm, ctx.flat_inputs(gm), optimizer=optimizer,
                                              accumulate=accumulate).peak_bytes <= target:
            return min(size, rows)


def _fraction(value) -> float:
    value = float(value) if isinstance(value, (Text, numbers.Real)) and not isinstance(value, bool) else None
    if value is None or not 0 <= value < 0.5:
        raise ValueError("must be in [0, 0.5), e.g. 0.05 for 5%")
    return value


def _hoist_state_writes(gm: torch.fx.GraphModule) -> int:
    """Move each node that cannot be recomputed but reads only placeholders and attributes
    (num_batches_tracked.add_(1) beside each batch norm, from export or a BatchNorm written in
    Python) up to the last placeholder it reads, with the attribute reads it needs, when no
    node in between reads them: segments are then not cut around it."""
    moved = 0
    nodes = list(gm.graph.nodes)
    start = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=-1)
    for n in list(nodes):
        if n.op not in ("call_function", "call_method") or n.users or recomputable(n, gm) is None:
            continue
        inputs = n.all_input_nodes
        if not inputs or any(i.op not in ("placeholder", "get_attr") for i in inputs):
            continue
        k = nodes.index(n)
        place = max([start] + [nodes.index(i) for i in inputs if i.op == "placeholder"])
        state = {i.target for i in inputs if i.op == "get_attr"}
        movers = [i for i in inputs if i.op == "get_attr" and nodes.index(i) > place] + [n]
        if place >= k or nodes[place + 1:place + 1 + len(movers)] == movers:
            continue  # among the placeholders (fx's asserts on concrete arguments), or already there
        if any(i in inputs or (i.op == "get_attr" and i.target in state)
               for m in nodes[place + 1:k] for i in m.all_input_nodes):
            continue
        anchor = nodes[place] if place >= 0 else None
        for m in movers:
            nodes.remove(m)
            if anchor is None:
                next(iter(gm.graph.nodes)).prepend(m)
            else:
                anchor.append(m)
            nodes.insert(nodes.index(anchor) + 1 if anchor is not None else 0, m)
            anchor = m
        moved += 1
    return moved


def _attributes_first(gm: torch.fx.GraphModule) -> int:
    """Move every attribute read to just after the placeholders. A segment reads the attributes
    it needs itself, so one left inside its node range would stay behind in the main graph and
    undoing the segment would put the nodes back in another order than the plan's."""
    nodes = list(gm.graph.nodes)
    anchor = next((n for n in reversed(nodes) if n.op == "placeholder"), None)
    moved = 0
    for n in nodes:
        if n.op != "get_attr":
            continue
        if anchor is None:
            first = next(iter(gm.graph.nodes))
            if first is not n:
                first.prepend(n)
                moved += 1
        elif anchor.next is not n:
            anchor.append(n)
            moved += 1
        anchor = n
    return moved


def _node_facts(gm: torch.fx.GraphModule, facts):
    """Per node in graph order: bytes kept for backward, bytes live after it, recomputable, the
    bytes a selective segment keeps of it, and the parameter gradients its backward makes
    first (of the trainable parameters it is the last to read: backward runs in reverse)."""
    nodes = list(gm.graph.nodes)
    kept, live_after = facts.kept_and_live(nodes)
    ok = [recomputable(n, gm) is None for n in nodes]
    sel = [facts.policy_bytes.get(n.name, 0) for n in nodes]
    last_reader = {}
    for i, n in enumerate(nodes):
        for key, p in params_read(gm, n).items():
            if p.requires_grad:
                last_reader[key] = (i, p.untyped_storage().nbytes())
    grads = [0] * len(nodes)
    for i, nbytes in last_reader.values():
        grads[i] += nbytes
    return nodes, kept, live_after, ok, sel, grads


@register
class Recompute(Pass):
    """Recompute the cheapest activations in backward so a training step fits budget_gb."""

    name = "recompute"
    runs_after = plans_memory_after("fuse", "inplace", "precision")
    arguments = {"budget_gb": "budget_gb", "profile": "profile", "calibrate": "calibrate", "optimizer": "optimizer",
                 "accumulate": "accumulate"}
    yields_to = ("stages",)
    options = {
        "budget_gb": Option(None, positive, "peak memory of one training step, in GB of 10**9 bytes"),
        "headroom": Option(None, _fraction, "fraction of the budget kept free for what the estimate cannot see, "
                                            "in [0, 0.5); default 0 on CPU, CUDA_HEADROOM on CUDA"),
        "profile": Option(False, to_bool, "cost recompute by each node's measured time instead of its estimate"),
        "calibrate": Option(False, to_bool, "measure one real step and plan again while it is over budget"),
        "optimizer": Option(None, check_optimizer, "the optimizer whose state and step() the budget covers: "
                                                   "a torch.optim.Optimizer or " + ", ".join(NAMED)),
        "accumulate": Option(False, to_bool, "the step runs with every .grad present, backward adding into it "
                                             "(gradient accumulation): the budget covers them from the start"),
    }

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        budget_gb = self.settings["budget_gb"]
        if budget_gb is None:
            raise BudgetError("the recompute pass needs budget_gb, e.g. recompute{budget_gb=8}.")
        limit = budget_bytes(budget_gb)
        inputs = ctx.flat_inputs(gm)
        self.headroom = self.settings["headroom"]
        if self.headroom is None:
            self.headroom = CUDA_HEADROOM if graph_device(gm) == "cuda" else 0.0
        target = int(limit * (1 - self.headroom))
        optimizer = self.settings["optimizer"]
        self.optimizer = optimizer_memory(optimizer, list(gm.parameters())) if optimizer is not None and ctx.train else None
        # Step 1 (with step 2's tidying first, so that one estimate serves the search too)
        self.accumulate = self.settings["accumulate"] and ctx.train
        tidied = ctx.train and bool(_attributes_first(gm) + _hoist_state_writes(gm))
        if tidied:
            gm.recompile()
        before = ctx.analysis(estimate_peak, gm, train=ctx.train, optimizer=self.optimizer, accumulate=self.accumulate)
        stats = {"budget_bytes": limit, "planned_for_bytes": target, "peak_before_bytes": before.peak_bytes}
        if not ctx.train:
            if before.peak_bytes > target:
                raise self._error(budget_gb, before.peak_bytes, before.breakdown, inference=True)
            _warn_idle(stats)
            return PassResult(gm, False, {**stats, "predicted_peak_bytes": before.peak_bytes},
                              call_checks=[self._check(budget_gb, target, ctx)])
        chunk = _size_chunks(gm, ctx, target, self.optimizer, self.accumulate)
        if chunk is not None:
            stats["loss_chunk_rows"] = chunk
            before = ctx.analysis(estimate_peak, gm, train=ctx.train, optimizer=self.optimizer, accumulate=self.accumulate)
        if before.peak_bytes <= target:
            _warn_idle(stats)
            written, before = self._write_in_place(gm, ctx, None, None, before)
            return PassResult(gm, tidied or chunk is not None or bool(written),
                              {**stats, "predicted_peak_bytes": before.peak_bytes, "segments": 0,
                               "written_in_place": written}, _pictures({"as traced": before}, limit),
                              call_checks=[self._check(budget_gb, target, ctx)])
        # Step 2
        facts = ctx.analysis(record_step, gm)
        nodes, kept, live_after, ok, sel, grads = _node_facts(gm, facts)
        saves = facts.save_points(nodes)
        device = "cuda" if graph_device(gm) == "cuda" else "cpu"
        cost = forward_costs(gm, nodes, device, ctx.analysis(node_times, gm) if self.settings["profile"] else None)
        flops = [ops.flops(n, gm) if n.op.startswith("call") else 0 for n in nodes]
        r = rates(device)
        policy_calls = [facts.policy_calls.get(n.name, 0) for n in nodes]
        space = PlanSpace(nodes, ok, kept, live_after, grads, cost, saves, sel, policy_calls, flops,
                          SegmentCost(round(r.segment_s * 1e9), round(r.policy_op_s * 1e9)))
        # Step 3
        pricer = PlanPricer(before.log, facts, nodes, saves)
        search = _Search(gm, inputs, nodes, sel, saves, sorted(space.blocks, key=lambda p: (p.recompute_cost,
                         p.predicted_peak)), self.optimizer, self.accumulate, space.leaner, space.grown, pricer,
                         Scan(space))
        if not self.settings["calibrate"]:  # calibrating measures the plan without the writes first
            search.finish = lambda plan: self._written(gm, ctx, search, plan)
        # Steps 4 and 5
        plan, after = search.cheapest_within(target)
        if plan is None:  # without a plan at all, nothing may be recomputed: the step as it is is the least
            least = min((e for e in (after, before) if e is not None), key=lambda e: e.peak_bytes)
            raise self._error(budget_gb, least.peak_bytes, least.breakdown, inference=False)
        if self.settings["calibrate"]:
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
                    raise self._error(budget_gb, after.peak_bytes + measured - limit, after.breakdown,
                                      inference=False, measured=True)
                search.rewrite(plan)
            else:
                stats["measured_peak_bytes"] = _measure(gm, ctx, self.accumulate)
                if stats["measured_peak_bytes"] > limit:
                    raise self._error(budget_gb, stats["measured_peak_bytes"], after.breakdown,
                                      inference=False, measured=True)
            search.undo()
        # Step 6, and the plan's segments cut, where the search did not do both
        if search.finished is not None:
            written, after = search.finished
        else:
            written, after = self._write_in_place(gm, ctx, search, plan, after,
                                                  search.with_writes.get(tuple(plan.segments)))
        # Step 7
        for n in gm.graph.nodes:
            if isinstance(n.target, SegmentCall):
                note(n, "recompute", f"segment {n.target.index}" + (" (selective)" if n.target.selective else ""))
                for i in n.all_input_nodes:
                    if i.op.startswith("call"):
                        note(i, "recompute", "boundary")
        recomputed = [i for i, n in enumerate(nodes) if search.decision.get(n) == "recomputed"]
        stats.update({
            "predicted_peak_bytes": after.peak_bytes,
            "segments": len(plan.segments),
            "selective_segments": sum(s.selective for s in plan.segments),
            "recomputed_nodes": len(recomputed),
            "recompute_flops": sum(flops[i] for i in recomputed),
            "recompute_overhead_pct": round(100 * plan.recompute_cost / max(STEP_FORWARDS * sum(cost), 1), 1),
            "cost_by": "measured time" if self.settings["profile"] else f"estimated time ({device})",
            "recompute_ms": round(plan.recompute_cost / 1e6, 3),
            "written_in_place": written,
        })
        return PassResult(gm, True, stats, _pictures({"as traced": before, "with recompute": after}, limit),
                          call_checks=[self._check(budget_gb, target, ctx)])

    def _check(self, budget_gb: float, target: int, ctx: PassContext) -> BudgetCheck:
        """The plan fits the budget at the example's sizes; other sizes run correctly but could
        exceed it, so a call at them is estimated first (runtime/budget_check.py)."""
        return BudgetCheck(budget_gb, target, ctx.train, self.optimizer, self.accumulate,
                           (ctx.example_args, ctx.example_kwargs))

    def _write_in_place(self, gm: torch.fx.GraphModule, ctx: PassContext, search: _Search | None, plan,
                        estimate: Estimate, known: Estimate | None = None) -> tuple[dict, Estimate]:
        """Step 6, on gm before its segments are cut, which it then cuts: the ops written in
        place within the plan, by name, and the step's estimate. Measured, not assumed: where the
        writes raise the estimate, the graph goes back to the plan without them (GPT-NeoX's
        per-layer plan, before the inplace rules left views autograd tracks alone). known: the
        estimate of the plan with its writes, where the search made it already."""
        if known is not None and known.peak_bytes > estimate.peak_bytes:
            self._cut(gm, search, plan)
            return {}, estimate
        found = self._written(gm, ctx, search, plan, known)
        if found is not None:
            written, after, before = found
            if after.peak_bytes <= estimate.peak_bytes:
                return written, after
            _put_back(gm, before, search)
        self._cut(gm, search, plan)
        return {}, estimate

    def _written(self, gm: torch.fx.GraphModule, ctx: PassContext, search: _Search | None, plan,
                 known: Estimate | None = None) -> tuple[dict, Estimate, torch.fx.Graph] | None:
        """Where the pipeline has the inplace pass (which a budget skips by default) and its rules
        and the plan's allow a write (in_place.py): the writes, by name, made in gm with the plan's
        segments cut, the step's estimate and gm's graph as it was (for _put_back); None, gm
        untouched, where no write is allowed. known: that estimate, made before on the same graph."""
        if "inplace" not in ctx.pipeline:
            return None
        before = torch.fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        # its nodes' metadata copied with them, and the output's type (the code's return annotation)
        before.output(before.graph_copy(gm.graph, {}), type_expr=output.type)
        before._codegen = gm.graph._codegen  # export's pytree calling convention
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
            known = estimate_peak(gm, ctx.flat_inputs(gm), optimizer=self.optimizer, accumulate=self.accumulate)
        return written, known, before

    @staticmethod
    def _cut(gm: torch.fx.GraphModule, search: _Search | None, plan) -> None:
        """The plan's segments cut in gm's graph as it now is."""
        if search is not None:
            search.nodes[:] = list(gm.graph.nodes)  # each write replaced its node where it stood
            search.rewrite(plan)

    def _error(self, budget_gb: float, minimum: int, breakdown: dict, inference: bool,
               measured: bool = False) -> BudgetError:
        minimum = int(minimum / (1 - self.headroom))
        parts = {k: v for k, v in breakdown.items() if v}
        detail = ", ".join(f"{k} {size_text(v)}" for k, v in parts.items())
        what = "the forward pass (inference: nothing to recompute)" if inference else "one training step"
        how = "as measured" if measured else "by the estimate"
        # microbatches shrink a training step's activations; train_step's own refusal words its advice itself
        batch = "" if inference else (" run the step as microbatches with graphopt.train_step (the fewest that "
                                      "fit the budget, gradients accumulated),")
        return BudgetError(
            f"budget_gb={budget_gb:g} ({size_text(budget_bytes(budget_gb))}) is below the {size_text(minimum)} that "
            f"{what} needs at least, {how} ({detail}). Raise budget_gb to {budget_text(minimum)} or more, "
            f"halve activations with precision='bf16',{batch} or split the model over devices with stages=N.",
            min_budget_gb=minimum / GB, breakdown=parts,
        )


class _Search:
    """Candidate plans, each rewritten into gm and estimated at most once."""

    def __init__(self, gm: torch.fx.GraphModule, inputs: list, nodes: list[torch.fx.Node], sel: list[int],
                 saves: list[int], candidates: list, optimizer, accumulate: bool, leaner=lambda plan: [],
                 grown=lambda plan: [], pricer: PlanPricer | None = None, scan: Scan | None = None):
        self.gm, self.inputs, self.nodes, self.sel, self.candidates = gm, inputs, nodes, sel, candidates
        self.pricer, self.scan = pricer, scan
        # Where ties go: the solver's and the blocks' plans by cost and model peak, then those
        # the search made (leaner, grown) in the order it made them
        self.ranks = {k: (0, p.recompute_cost, p.predicted_peak, k) for k, p in enumerate(candidates)}
        self.saves, self.leaner, self.grown = saves, leaner, grown
        self.optimizer, self.accumulate = optimizer, accumulate
        # Step 6 done ahead of the plan's own fake step (the pass sets it): plan -> (writes, estimate,
        # the graph before) with gm written and cut, or None; what it did for the plan chosen
        self.finish = None
        self.finished: tuple[dict, Estimate] | None = None
        self.with_writes: dict[tuple, Estimate] = {}  # by a plan's segments, where it was not kept
        self.estimates: dict[int, Estimate] = {}  # by fake step
        self.prices: dict[int, int] = {}          # by pricing.py
        self.decision: dict[torch.fx.Node, str] = {}

    def rewrite(self, plan) -> None:
        """Rewrite gm with plan: its segment calls take their metadata from the nodes they replace."""
        self._decide(plan)  # before the rewrite: the nodes' copies in the segments share the notes
        checkpoint_segments(self.gm, [self.nodes[s.start:s.stop] for s in plan.segments],
                            [s.selective for s in plan.segments])

    def undo(self) -> None:
        """Put the segments' nodes back. Their copies keep the metadata the nodes had."""
        inline_segments(self.gm)
        self.nodes[:] = list(self.gm.graph.nodes)  # the inlined copies, in the same order

    def estimate(self, k: int) -> Estimate:
        if k not in self.estimates:
            self.rewrite(self.candidates[k])
            self.estimates[k] = estimate_peak(self.gm, self.inputs, optimizer=self.optimizer, accumulate=self.accumulate)
            self.undo()
        return self.estimates[k]

    def peak(self, k: int) -> int:
        """Candidate k's peak: its fake step's where it ran, else priced (pricing.py)."""
        if k in self.estimates or self.pricer is None:
            return self.estimate(k).peak_bytes
        if k not in self.prices:
            self.prices[k] = self.pricer.price(self.candidates[k].segments)
        return self.prices[k]

    def cheapest_within(self, target: int):
        """(plan, estimate) of the cheapest candidate whose peak is within target, confirmed by
        its fake step; (None, the smallest estimate seen) when none is, (None, None) when there
        is no plan at all."""
        while not self._beyond_reach(target):
            hi = self._cheapest_by_peak(target)
            if hi is None:
                break
            if self._finished_within(hi, target):
                return self.candidates[hi], self.finished[1]
            if self.estimate(hi).peak_bytes <= target:  # a price over by a hair gets its own look
                hi = next((k for k in self._near(hi, target)[:LOOK_NEAR] if self.estimate(k).peak_bytes <= target), hi)
                return self.candidates[hi], self.estimates[hi]
            # over after all: its fake step now stands for it, and the search runs again
        # none within target: the least is the smallest fake step of the plans priced lowest,
        # the next ones looked at only while priced within PRICE_MARGIN of the smallest so far
        # and within as much as the prices were off
        self._lowest()
        if not self.candidates:
            return None, None
        ranked = sorted(self._ordered(), key=self.peak)
        smallest = self.estimate(ranked[0]).peak_bytes
        for k in ranked[1:LOOK_LEAST]:
            if self.peak(k) - min(self.peak(k) * PRICE_MARGIN, self._price_error()) >= smallest:
                break
            smallest = min(smallest, self.estimate(k).peak_bytes)
        best = min(self.estimates, key=lambda k: self.estimates[k].peak_bytes)
        if self.estimates[best].peak_bytes <= target:
            return self.candidates[best], self.estimates[best]
        return None, self.estimates[best]

    def _near(self, hi: int, target: int) -> list[int]:
        """The plans cheaper than candidates[hi] priced over the target by no more than PRICE_MARGIN
        and than prices were off their fake steps so far, not yet estimated, cheapest first."""
        over = min(target * PRICE_MARGIN, self._price_error())
        return sorted((k for k, p in self.prices.items() if k not in self.estimates and target < p <= target + over
                       and self.candidates[k].recompute_cost < self.candidates[hi].recompute_cost),
                      key=lambda k: (self.candidates[k].recompute_cost, self._rank(k)))

    def _finished_within(self, hi: int, target: int) -> bool:
        """Step 6 in place of candidates[hi]'s own fake step, where it writes anything: the one
        fake step, of the plan with its writes, confirms both where it is within the target and
        the plan's price (the writes raise nothing, as far as the price knows) and no cheaper plan
        is near enough to look at. Otherwise gm goes back, and the plan is estimated alone."""
        if self.finish is None or hi in self.estimates or hi not in self.prices or self._near(hi, target):
            return False
        found = self.finish(self.candidates[hi])
        if found is None:
            return False
        written, estimate, before = found
        if estimate.peak_bytes <= min(target, self.prices[hi]):
            self.finished = written, estimate
            return True
        self.with_writes[tuple(self.candidates[hi].segments)] = estimate  # step 6 reads it again
        _put_back(self.gm, before, self)
        return False

    def _lowest(self) -> None:
        """The solver's plans priced lowest, solved where not yet (candidates.Scan.up)."""
        if self.scan is not None:
            for plan in self.scan.up(lambda plan: self.peak(self._add(plan, solved=True)), LOOK_LEAST):
                self._add(plan, solved=True)

    def _beyond_reach(self, target: int) -> bool:
        """Whether the plans priced lowest (the solver's at its least allowances, the blocks) are
        all priced over the target by more than REACH: then the least is what the search is for,
        and the solver's other allowances, dearer in memory, are not solved."""
        if self.scan is None:
            return False
        over = lambda k: self.peak(k) > target * (1 + REACH)  # noqa: E731
        return all(over(k) for k in range(len(self.candidates))) and \
            all(over(self._add(plan, solved=True)) for plan in self.scan.bottoms())

    def _price_error(self) -> int:
        """The most a price was off its plan's fake step so far: on a graph the prices hold
        exactly, a plan priced over the target is over."""
        return max((abs(self.prices[k] - e.peak_bytes) for k, e in self.estimates.items() if k in self.prices),
                   default=0)

    def _add(self, plan, solved: bool = False) -> int:
        """plan's index among the candidates, added where it is new; solved: one of the solver's
        lines (ranked with the first candidates), else one the search made."""
        known = {tuple(p.segments): k for k, p in enumerate(self.candidates)}
        k = known.get(tuple(plan.segments))
        if k is None:
            k = len(self.candidates)
            self.candidates.append(plan)
            if solved:
                self.ranks[k] = (0, plan.recompute_cost, plan.predicted_peak, k)
        return k

    def _rank(self, k: int) -> tuple:
        return self.ranks.get(k, (1, k))

    def _ordered(self) -> list[int]:
        return sorted(range(len(self.candidates)), key=self._rank)

    def _cheapest_by_peak(self, target: int) -> int | None:
        fits = lambda k: self.peak(k) <= target  # noqa: E731
        if self.scan is not None:
            for plan in self.scan.down(lambda plan: fits(self._add(plan, solved=True))):
                self._add(plan, solved=True)
        fitting = [k for k in self._ordered() if fits(k)]
        if not fitting:
            return None
        hi = min(fitting, key=lambda k: self.candidates[k].recompute_cost)
        hi = self._grow(hi, fits)
        # Costs within the time model's resolution are a tie: the plan rerunning fewer matmul FLOPs wins
        chosen = self.candidates[hi]
        for plan in self.leaner(chosen):
            self._add(plan)
        leaner = sorted((k for k in self._ordered() if self.candidates[k].matmul_flops < chosen.matmul_flops
                         and (self.candidates[k].recompute_cost <= chosen.recompute_cost
                              or len(self.candidates[k].segments) <= len(chosen.segments))
                         and self.candidates[k].recompute_cost <= chosen.recompute_cost * (1 + TIME_RESOLUTION)),
                        key=lambda k: (self.candidates[k].matmul_flops, self.candidates[k].recompute_cost))
        return next((k for k in leaner if fits(k)), hi)

    def _grow(self, hi: int, fits) -> int:
        """The cheapest of the dearest plan over the target grown (candidates.PlanSpace.grown)
        that fits and costs less than candidates[hi]; hi when none does."""
        cost = self.candidates[hi].recompute_cost
        over = [k for k in self._ordered() if self.candidates[k].recompute_cost < cost and not fits(k)]
        if not over:
            return hi
        known = {tuple(p.segments) for p in self.candidates}
        grown = [p for p in self.grown(self.candidates[max(over, key=lambda k: self.candidates[k].recompute_cost)])
                 if p.recompute_cost < cost and tuple(p.segments) not in known]
        for plan in grown[:LOOK_GROWN]:
            k = self._add(plan)
            if fits(k):
                return k
        return hi

    def _decide(self, plan) -> None:
        """Per node: kept, recomputed, or in a segment but past where its rerun stops; noted on
        it. By position: undoing a rewrite makes new nodes (under the same names)."""
        self.decision = {}
        for s in plan.segments:
            end = rerun_end(self.saves, s.start, s.stop)
            for i in range(s.start, s.stop):
                self.decision[self.nodes[i]] = ("kept" if s.selective and self.sel[i] else
                                                "recomputed" if i < end else "not rerun")
        for n in self.nodes:
            if n.op.startswith("call"):
                note(n, "recompute", self.decision.get(n, "kept"))


def _put_back(gm: torch.fx.GraphModule, before: torch.fx.Graph, search: _Search | None) -> None:
    """gm's graph as it was before _written wrote in place and cut, and the search's nodes with it."""
    gm.graph = before
    gm.recompile()
    if search is not None:
        search.nodes[:] = list(gm.graph.nodes)


def _measure(gm: torch.fx.GraphModule, ctx: PassContext, accumulate: bool) -> int:
    """Measured peak of one real training step; the model's buffers, gradients and RNG as before."""
    with trial_run(gm, (ctx.example_args, ctx.example_kwargs)):
        return measure_step(gm, ctx.example_args, ctx.example_kwargs, accumulate=accumulate)


def _warn_idle(stats: dict) -> None:
    """BudgetWarning where the step as traced fits the budget: a budget that asks for nothing is
    most often one in the wrong unit."""
    idle = idle_budget(stats)
    if idle:
        warn(idle, BudgetWarning)


def _pictures(curves: dict, budget_bytes: int) -> dict:
    """Dump files, made only when dumping."""
    return {"memory.png": lambda: memory_png(curves, budget_bytes), "memory.csv": lambda: memory_csv(curves)}
