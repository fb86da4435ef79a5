"""The plans the recompute pass looks at, each priced as it runs.

A plan's price: its recompute cost, each segment's rerun as it runs (to where
torch.utils.checkpoint stops it: solver.rerun_end; less the matmuls a selective segment keeps)
and what a segment costs besides (solver.SegmentCost); and the matmul FLOPs its reruns run.

Where plans come from:
  1. The solver (solver.py), at CANDIDATES activation allowances from the least it can meet
     to what needs no recompute, under two views of the cost: the rerun as it runs, and every
     node rerun. The solver's memory model is not the estimate: plans it holds equal in memory
     can differ by a tenth in the estimate, so where one view ranks a plan that does not fit
     first, the other's may fit (transformers' Llama at its own checkpointing's peak). And
     with full segments only, under the first view: a selective segment's price is the least
     certain part of the cost (its policy's dispatch, the FLOP rate of the matmuls it keeps),
     and where it is priced a little low the solver fills every allowance with selective plans.
     A plan of full segments that is the cheapest that fits by the price too can then go
     unproposed (timm's DenseNet-121 at its own checkpointing's peak). The full-only solve is skipped at an allowance
     where the selective one chose no selective segment: it would choose the same plan among
     fewer. Each line (a view, selective or full only) is solved from its largest allowance
     down as the search needs it (LinePlans): its cheapest plan that fits is its first from the top
     that does, and the least budget, which no plan meets, is among its lowest. A solve is
     given a cost its least is likely within, which only saves it time (solver.solve's bound):
     the line's least at the allowance below, solved first for it, and the first line's plan
     at the same allowance in the others' terms; else one it likely exceeds (the line's most
     at a larger allowance), from which the solver guesses bounds.
  2. The model's own blocks (block_plans), as its one-line checkpointing would recompute them,
     and cut after their first matmul, as timm's DenseNet checkpoints its dense layers.
  3. Near a chosen plan's allowance (leaner), the solver with a matmul's rerun priced as the
     whole step: plans that rerun as few matmul FLOPs as the memory allows.
  4. Next to a plan just over the budget (grown): each of its segments grown by a few nodes at
     one end. The solver's model can miss a plan by one node: transformers' BERT at its own
     checkpointing's peak, two per-layer segments over by 1.5%, fit with the second one node
     longer (over its attention's output projection), for 12% less estimated cost than the
     four-segment plan the search had.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

from ...analysis.blocks import block_levels
from .solver import RecomputePlan, Segment, SegmentCost, fits, make_atoms, model_peak, rerun_cost, rerun_end, solve

CANDIDATES = 16   # allowances per line; every plan found is priced (pricing.py)
# The solver's lines, (view, selective): the rerun as it runs with selective segments and with
# full ones only, every node rerun with selective segments.
LINES = ((0, True), (0, False), (1, True))
LEAN_ALLOWANCES = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9)  # of a chosen plan's allowance, for leaner plans
GROW_BY = (1, 2, 4, 8)  # nodes a segment of a plan over the budget is grown by


@dataclass
class PlanSpace:
    """Per node in graph order (node_facts.py): the node, whether it may run twice,
    the bytes it keeps for backward and those live after it, the parameter gradients its backward
    makes first, its recompute cost, when it saves (analysis/saved.save_points), what a selective
    segment keeps of it (bytes), the aten calls a selective segment's policy sees in it
    (analysis/saved.StepFacts.policy_calls) and its FLOPs; what a segment costs."""

    nodes: list[torch.fx.Node]
    ok: list[bool]
    kept: list[int]
    live_after: list[int]
    grads: list[int]
    cost: list[int]
    saves: list[int]
    sel: list[int]
    ops: list[int]
    flops: list[int]
    segment_cost: SegmentCost
    barriers: tuple[int, ...] = ()  # positions no segment runs across (the shard pass's block bounds)
    views: list = field(init=False)
    blocks: list = field(init=False)
    _solved: dict = field(init=False, default_factory=dict)  # line_plan's, by (line, k)
    # the least allowance and none: the views differ in cost only, their atoms and memory the same
    _allowances: tuple | None = field(init=False, default=None)
    _costs: dict = field(init=False, default_factory=dict)   # the solver's cost of line_plan's, by (line, k)

    def __post_init__(self):
        self.matmul_flops = [f if b else 0 for f, b in zip(self.flops, self.sel)]  # what a selective segment keeps
        heavy = [c + (sum(self.cost) if m else 0) for c, m in zip(self.cost, self.matmul_flops)]
        # per view, each node's cost, save point (None: every node reruns) and cost a selective segment keeps
        self.view_costs = [(c, saves, [x if b else 0 for x, b in zip(c, self.sel)])
                           for c, saves in ((self.cost, self.saves), (self.cost, None), (heavy, self.saves))]
        self.blocks = block_plans(self.nodes, self.ok, self.live_after, self.sel, self.priced)
        bounds = {k for p in self.blocks for s in p.segments for k in (s.start, s.stop)} | set(self.barriers)
        self.views = [make_atoms(self.kept, self.live_after, c, self.ok, self.sel, kept, param_grads=self.grads,
                                 ops=self.ops, saves=saves, boundaries=bounds)
                      for c, saves, kept in self.view_costs]

    def priced(self, segments, predicted_peak: int = 0) -> RecomputePlan:
        segments = _clipped(segments, self.barriers)
        lean = sum(self.matmul_flops[i] for s in segments if not s.selective
                   for i in range(s.start, rerun_end(self.saves, s.start, s.stop)))
        return RecomputePlan(list(segments), self.cost_in(segments), predicted_peak, lean)

    def cost_in(self, segments, view: int = 0, selective: bool = True) -> int:
        """What segments cost in a view's terms, as its solver counts it; selective False: each as a
        full segment."""
        cost, saves, kept = self.view_costs[view]
        return sum(rerun_cost(cost, saves, s.start, s.stop, kept if s.selective and selective else None)
                   + self.segment_cost.fixed + (self.segment_cost.per_selective_op * sum(self.ops[s.start:s.stop])
                                                if s.selective and selective else 0)
                   for s in segments)

    def line_plan(self, line: tuple[int, bool], k: int) -> RecomputePlan | None:
        """Step 1: the solver's plan on a line (view, selective) at its k-th allowance, from the
        least it can meet (k = 0) to none (CANDIDATES - 1), priced; None where it cuts no segment,
        and for full segments only where the selective solve there chose no selective segment
        (the same plan among fewer)."""
        if (line, k) not in self._solved:
            view, selective = line
            atoms = self.views[view]
            if self._allowances is None:
                self._allowances = (_least_allowance(atoms), model_peak(atoms, []))
            low, high = self._allowances
            allowance = int(low * (high / low) ** (k / (CANDIDATES - 1))) if low else high
            beside = None if selective else self.line_plan((view, True), k)  # the selective solve there
            plan = None
            if selective or (beside is not None and any(s.selective for s in beside.segments)):
                plan = solve(atoms, allowance, segment_cost=self.segment_cost, selective=selective,
                             bound=self._bound(line, k), floor=self._floor(line, k))
            if plan is not None and plan.segments:
                self._costs[line, k] = plan.recompute_cost
            self._solved[line, k] = (self.priced(plan.segments, plan.predicted_peak)
                                     if plan is not None and plan.segments else None)
        return self._solved[line, k]

    def solved(self, line: tuple[int, bool], k: int) -> bool:
        return (line, k) in self._solved

    def _bound(self, line: tuple[int, bool], k: int) -> int | None:
        """A cost the solver's least at (line, k) is likely within, which saves the solve time
        (solver.solve's bound): the least solved on the line at a smaller allowance, and what
        the first line's plan at k costs in this line's terms (its view, its segments full where
        the line has none selective)."""
        found = [c for (at, j), c in self._costs.items() if at == line and j < k]
        first = self._solved.get((LINES[0], k))
        if line != LINES[0] and first is not None:
            view, selective = line
            found.append(self.cost_in(first.segments, view, selective))
        return min(found, default=None)

    def _floor(self, line: tuple[int, bool], k: int) -> int | None:
        """A cost the solver's least at (line, k) likely exceeds: the most solved on the line at a
        larger allowance (the solver's cost falls as the allowance grows)."""
        return max((c for (at, j), c in self._costs.items() if at == line and j > k), default=None)

    def leaner(self, plan: RecomputePlan) -> list[RecomputePlan]:
        """Step 3, from the smallest allowance up: each plan's cost bounds the next's."""
        found, bound = [], None
        for f in sorted(LEAN_ALLOWANCES):
            p = solve(self.views[2], int(plan.predicted_peak * f), segment_cost=self.segment_cost, bound=bound)
            if p is not None and p.segments:
                found.append(self.priced(p.segments, p.predicted_peak))
                bound = p.recompute_cost
        return found[::-1]  # as LEAN_ALLOWANCES

    def grown(self, plan: RecomputePlan) -> list[RecomputePlan]:
        """Step 4: plan with one segment grown by GROW_BY nodes at its start or its end, over
        nodes that may run twice and apart from its other segments, cheapest first."""
        segments, found = plan.segments, {}
        for i, seg in enumerate(segments):
            low = segments[i - 1].stop if i else 0
            high = segments[i + 1].start if i + 1 < len(segments) else len(self.nodes)
            for by in GROW_BY:
                for start, stop in ((seg.start - by, seg.stop), (seg.start, seg.stop + by)):
                    if low <= start and stop <= high and all(self.ok[start:stop]):
                        variant = [*segments[:i], Segment(start, stop, seg.selective), *segments[i + 1:]]
                        found.setdefault(tuple(variant), self.priced(variant))
        return sorted(found.values(), key=lambda p: p.recompute_cost)


class LinePlans:
    """The lines' plans solved as the search needs them, each line from its largest allowance
    down: the solver's cost falls as the allowance grows, so the cheapest plan of a line that
    fits is its first from the top that does. Past it, one allowance more (a plan a little
    dearer with fewer matmul FLOPs can win: the search's tie rule). For the least, each line
    from its least allowance up, while its plans are priced among the lowest (up)."""

    def __init__(self, space: PlanSpace):
        self.space = space
        self.next = {line: CANDIDATES - 1 for line in LINES}  # the next allowance down to solve
        self.solved = {line: [] for line in LINES}             # the allowances with a plan, from the top
        self.low = {line: 0 for line in LINES}                 # the next allowance up to solve (up)
        self.climbed = False                                   # up ran (once: the least's plans)

    def down(self, holds) -> list[RecomputePlan]:
        """Solve on down each line whose plans so far hold none that fits (holds(plan): the
        search's word, by price or by fake step, which can change), to one allowance past the
        first that does; the plans solved now."""
        found = []
        for line in LINES:
            while self.next[line] >= 0:
                fit = next((k for k in self.solved[line] if holds(self.space.line_plan(line, k))), None)
                if fit is not None and self.next[line] < fit - 1:
                    break
                k = self.next[line]
                self.next[line] -= 1
                if fit is None and k >= 1 and not self.space.solved(line, k):
                    # a look for the first fit: the allowance below, which the scan solves next,
                    # solved first, as its cost bounds k's (every other solve of a line bounded so)
                    self.space.line_plan(line, k - 1)
                plan = self.space.line_plan(line, k)
                if plan is not None:
                    self.solved[line].append(k)
                    found.append(plan)
        return found

    def bottoms(self):
        """Each line's plan at its least allowance, solved as the caller takes it."""
        for line in LINES:
            plan = self.space.line_plan(line, 0)
            if plan is not None:
                yield plan

    def up(self, price, lowest: int) -> list[RecomputePlan]:
        """For the least, which the plans priced lowest hold: each line solved from its least
        allowance up, until two allowances in a row are priced (price(plan)) over the `lowest`-th
        lowest price so far; the plans solved now, once."""
        found, prices = [], []
        if self.climbed:
            return found
        self.climbed = True
        for line in LINES:
            over = 0
            while over < 2 and self.low[line] <= self.next[line]:
                plan = self.space.line_plan(line, self.low[line])
                self.low[line] += 1
                if plan is None:
                    continue
                found.append(plan)
                p = price(plan)
                over = over + 1 if len(prices) >= lowest and p > sorted(prices)[lowest - 1] else 0
                prices.append(p)
        return found


def _least_allowance(atoms) -> int:
    """Smallest activation allowance the solver can meet, by bisection."""
    lo, hi = 0, model_peak(atoms, [])
    while hi - lo > max(hi // 256, 1):
        mid = (lo + hi) // 2
        if not fits(atoms, mid):
            lo = mid
        else:
            hi = mid
    return hi


def block_plans(nodes: list[torch.fx.Node], ok: list[bool], live_after: list[int], sel: list[int],
                priced) -> list[RecomputePlan]:
    """Plans that recompute each repeated block whole, as a model's own one-line checkpointing
    does (transformers' decoder layers, timm's blocks or stages): one plan per level of
    numbered children in the module tree (analysis/blocks.py). A block's
    nodes are those that may run twice: a state write runs once wherever it is (BatchNorm's
    num_batches_tracked, moved to the top: tidy.hoist_state_writes). A block whose
    nodes are not contiguous, or hold between them one that cannot run twice, is left out. The solver's model ranks these
    plans less well than it ranks its own, and a one-line plan is the baseline a user compares
    with. Each plan also with its blocks cut after their first matmul: that matmul saves only its
    input, so the rerun stops before it and reruns no matmul, while the block's first values (a
    concatenation, a norm and its activation) are not kept, as timm's DenseNet checkpoints each
    dense layer's concatenation, norm1 and conv1."""
    plans = []
    for blocks in block_levels(nodes, lambda i: ok[i]).values():
        segments = []
        for members in blocks.values():
            start, stop = min(members), max(members) + 1
            inside = set(members)
            if all(ok[k] and (k in inside or not nodes[k].op.startswith("call")) for k in range(start, stop)):
                segments.append(Segment(start, stop, False))
        if len(segments) < 2:
            continue
        segments.sort(key=lambda seg: seg.start)
        # and the same with the runs between the blocks (embeddings, the head) recomputed too
        between, start = [], None
        bounds = {k for seg in segments for k in range(seg.start, seg.stop)}
        for k in range(len(nodes) + 1):
            free = k < len(nodes) and k not in bounds and ok[k] and nodes[k].op.startswith("call")
            if free and start is None:
                start = k
            elif not free and start is not None:
                between.append(Segment(start, k, False))
                start = None
        variants = [segments, sorted(segments + between, key=lambda seg: seg.start)]
        variants += [[cut for seg in chosen for cut in _to_first_matmul(seg, sel)] for chosen in variants]
        # The first blocks' backward runs last, when every parameter gradient is alive: their
        # rerun can set the peak. Halving them at their cheapest inner cut lowers it.
        for k in range(1, min(3, len(segments)) + 1):
            variants.append([half for seg in segments[:k] for half in _halves(seg, live_after)] + segments[k:])
        for chosen in variants:
            if chosen:
                plans.append(priced(chosen))
    return plans


def _clipped(segments, barriers: tuple[int, ...]) -> list[Segment]:
    """segments cut at every barrier inside them."""
    if not barriers:
        return list(segments)
    out = []
    for s in segments:
        cuts = [s.start, *(b for b in sorted(barriers) if s.start < b < s.stop), s.stop]
        out += [Segment(a, b, s.selective) for a, b in zip(cuts, cuts[1:])]
    return out


def _to_first_matmul(seg: Segment, sel: list[int]) -> list[Segment]:
    """seg up to and with its first matmul (what a selective segment keeps: sel), where
    something runs before it; none otherwise."""
    first = next((i for i in range(seg.start, seg.stop) if sel[i]), None)
    return [Segment(seg.start, first + 1, False)] if first is not None and first > seg.start else []


def _halves(seg: Segment, live_after: list[int]) -> list[Segment]:
    """seg cut in two where the fewest bytes cross, nearest its middle among equals."""
    if seg.stop - seg.start < 2:
        return [seg]
    cut = min(range(seg.start + 1, seg.stop),
              key=lambda i: (live_after[i - 1], abs(2 * i - seg.start - seg.stop)))
    return [Segment(seg.start, cut, seg.selective), Segment(cut, seg.stop, seg.selective)]
