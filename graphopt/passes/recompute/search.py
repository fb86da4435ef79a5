"""The recompute pass's step 4: the cheapest candidate plan whose step fits the target.

Candidates come from the plan space (candidates.py) as the search asks; each is priced from the
log of the step as it is (pricing.py), and the one chosen is confirmed by a fake step of its own
(estimate_step, the pass's: memory.estimate_peak of the graph rewritten with the plan). Ties on
cost go to the plan rerunning fewer matmul FLOPs; a plan just over the target is grown by a few
nodes (PlanSpace.grown); where none fits, the least is the smallest fake step of the plans
priced lowest. The algorithm, step by step, is in recompute_pass.py.
"""
from __future__ import annotations

from typing import Callable

import torch.fx

from ...analysis.memory import Estimate
from ..notes import note
from .candidates import PlanSpace, LinePlans
from .pricing import PlanPricer
from .rewrite import checkpoint_segments, inline_segments
from .solver import rerun_end

# Costs this close are a tie, which the plan rerunning fewer matmul FLOPs (work that grows with
# the model's width, and a GPU's largest) wins, unless it is the dearer and cuts more segments: a
# segment's own cost (its hooks, its rerun's dispatch) is what the time model knows least.
TIME_RESOLUTION = 0.05
LOOK_GROWN = 8    # grown plans priced against the budget
# Pricing is a model (pricing.py): a cheaper plan priced at most this far over the target
# gets a fake step of its own (up to LOOK_NEAR), and when none fits, so do plans priced within
# it of the smallest estimate (up to LOOK_LEAST in all).
PRICE_MARGIN = 0.01
LOOK_NEAR = 4
LOOK_LEAST = 3
# Plans a line solves at larger allowances keep more, so their prices rise along the line: when
# its lowest are priced this far over the target, no larger allowance of it fits, and the search
# looks for the least only.
REACH = 0.1


class PlanSearch:
    """Candidate plans, each rewritten into gm and estimated at most once."""

    def __init__(self, gm: torch.fx.GraphModule, space: PlanSpace, candidates: list,
                 estimate_step: Callable[[], Estimate], pricer: PlanPricer | None = None,
                 scan: LinePlans | None = None):
        """candidates: the plans to start from (the space's blocks); estimate_step: the fake step of
        gm as it is now."""
        self.gm, self.candidates, self.estimate_step = gm, candidates, estimate_step
        self.nodes, self.sel, self.saves = space.nodes, space.sel, space.saves
        self.leaner, self.grown = space.leaner, space.grown
        self.pricer, self.scan = pricer, scan
        # Where ties go: the solver's and the blocks' plans by cost and model peak, then those
        # the search made (leaner, grown) in the order it made them
        self.ranks = {k: (0, p.recompute_cost, p.predicted_peak, k) for k, p in enumerate(candidates)}
        # Step 6 done ahead of the plan's own fake step (the pass sets it): plan -> (writes, estimate,
        # the graph before) with gm written and cut, or None; what it did for the plan chosen
        self.finish = None
        self.finished: tuple[dict, Estimate] | None = None
        self.with_writes: dict[tuple, Estimate] = {}  # by a plan's segments, where it was not kept
        self.estimates: dict[int, Estimate] = {}  # by fake step
        self.prices: dict[int, int] = {}          # by pricing.py
        self.decision: dict[torch.fx.Node, str] = {}
        self.offload = False  # full segments keep their inputs on the host (the pass's step 10)

    def rewrite(self, plan) -> None:
        """Rewrite gm with plan: its segment calls take their metadata from the nodes they replace."""
        self._decide(plan)  # before the rewrite: the nodes' copies in the segments share the notes
        checkpoint_segments(self.gm, [self.nodes[s.start:s.stop] for s in plan.segments],
                            [s.selective for s in plan.segments], self.offload)

    def undo(self) -> None:
        """Put the segments' nodes back. Their copies keep the metadata the nodes had."""
        inline_segments(self.gm)
        self.nodes[:] = list(self.gm.graph.nodes)  # the inlined copies, in the same order

    def estimate(self, k: int) -> Estimate:
        if k not in self.estimates:
            self.rewrite(self.candidates[k])
            self.estimates[k] = self.estimate_step()
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
        restore_graph(self.gm, before, self)
        return False

    def _lowest(self) -> None:
        """The solver's plans priced lowest, solved where not yet (candidates.LinePlans.up)."""
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


def graph_snapshot(source: torch.fx.GraphModule | torch.fx.Graph,
                   owner: torch.fx.GraphModule | None = None) -> torch.fx.Graph:
    """A copy of source's graph for restore_graph, owned by owner (by default source itself): its
    nodes with their metadata, the output's type (the code's return annotation) and export's
    pytree calling convention."""
    graph = source.graph if isinstance(source, torch.fx.GraphModule) else source
    copied = torch.fx.Graph(owning_module=owner if owner is not None else source, tracer_cls=graph._tracer_cls)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    copied.output(copied.graph_copy(graph, {}), type_expr=output.type)
    copied._codegen = graph._codegen
    return copied


def restore_graph(gm: torch.fx.GraphModule, before: torch.fx.Graph, search: PlanSearch | None) -> None:
    """gm's graph as it was before _written wrote in place and cut, and the search's nodes with it."""
    gm.graph = before
    gm.recompile()
    if search is not None:
        search.nodes[:] = list(gm.graph.nodes)
