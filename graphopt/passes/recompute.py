"""recompute: insert recompute checkpoints so one training step fits budget_gb (GB = 10**9 bytes).

Algorithm:
  1. Estimate the step's peak as it is (memory.estimate_peak). Within budget: nothing to do.
     In inference only the forward runs and recompute cannot help: over budget is an error.
  2. State writes that read no computed value move up (they would cut segments). Per node,
     from one recorded FakeTensor forward (saved.py): the bytes it keeps for backward, the
     bytes live across it, its FLOPs (ops.flops), whether
     it may run twice (checkpointing.recomputable), and what a selective segment keeps of it.
  3. Candidate plans (solver.py): the least recompute FLOPs for each of CANDIDATES
     activation allowances, from the least the solver can meet to none; the distinct plans
     by increasing FLOPs. The solver's model ranks plans; it is not exact.
  4. The full estimate of each plan it looks at (rewritten through torch.utils.checkpoint,
     checkpointing.py, then undone) decides: the plan with most FLOPs must fit, or
     BudgetError names the smallest estimated peak as the least budget that works. Then a
     bisection over the candidates finds the least-FLOPs plan that fits.
  5. Rewrite with that plan.
  6. Mark every node kept, recomputed or boundary (a segment's inputs), and report.
"""
from __future__ import annotations

import torch
import torch.fx

from .. import ops
from ..checkpointing import RecomputeSegment, checkpoint_segments, inline_segments, recomputable
from ..dump import note
from ..errors import BudgetError
from ..memory import GB, estimate_peak
from ..saved import record_step
from ..solver import make_atoms, model_peak, solve
from ..trace import annotate
from .base import Option, Pass, PassContext, PassResult
from .registry import register

CANDIDATES = 16  # allowances tried; the estimate checks about log2 of them
LOOK_BELOW = 3   # cheaper candidates checked after the bisection


def _least_allowance(atoms) -> int:
    """Smallest activation allowance the solver can meet, by bisection."""
    lo, hi = 0, model_peak(atoms, [])
    while hi - lo > max(hi // 256, 1):
        mid = (lo + hi) // 2
        if solve(atoms, mid) is None:
            lo = mid
        else:
            hi = mid
    return hi


def _candidates(atoms) -> list:
    """The solver's plans for allowances from the least it can meet to what needs no
    recompute, distinct, by increasing recompute FLOPs (and so, roughly, decreasing peak)."""
    low, high = _least_allowance(atoms), model_peak(atoms, [])
    plans = {}
    for k in range(CANDIDATES):
        allowance = int(low * (high / low) ** (k / (CANDIDATES - 1))) if low else high
        plan = solve(atoms, allowance)
        if plan is not None and plan.segments:
            plans.setdefault(tuple(plan.segments), plan)
    return sorted(plans.values(), key=lambda p: (p.recompute_flops, p.predicted_peak))


def _positive(value) -> float:
    value = float(value)
    if value <= 0:
        raise ValueError("must be positive")
    return value


def _fraction(value) -> float:
    value = float(value)
    if not 0 <= value < 0.5:
        raise ValueError("must be in [0, 0.5), e.g. 0.05 for 5%")
    return value


def _hoist_state_writes(gm: torch.fx.GraphModule) -> int:
    """Move each node that cannot be recomputed but reads only placeholders and attributes
    (torch.export's num_batches_tracked.add_(1) beside each batch norm) up to where its inputs
    exist, when no node in between reads them: segments are then not cut around it."""
    moved = 0
    nodes = list(gm.graph.nodes)
    for k, n in enumerate(nodes):
        if n.op not in ("call_function", "call_method") or recomputable(n, gm) is None or n.users:
            continue
        inputs = n.all_input_nodes
        if not inputs or any(i.op not in ("placeholder", "get_attr") for i in inputs):
            continue
        place = max(nodes.index(i) for i in inputs)
        if any(i in m.all_input_nodes for m in nodes[place + 1:k] for i in inputs):
            continue
        if place + 1 < k:
            nodes[place].append(n)
            nodes.insert(place + 1, nodes.pop(k))
            moved += 1
    return moved


def _node_facts(gm: torch.fx.GraphModule, facts):
    """Per node in graph order: bytes kept for backward, bytes live after it, FLOPs, recomputable,
    and the bytes and FLOPs of its output when a selective segment keeps it."""
    nodes = list(gm.graph.nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    saved_storages = {s.storage for items in facts.saved.values() for s in items if s.source == "node"}
    kept = [0] * len(nodes)
    for name, items in facts.saved.items():
        kept[index[name]] += sum({s.storage: s.nbytes for s in items if s.source == "internal"}.values())
    made, last_use = facts.lifetimes(nodes)
    # Inputs are resident whatever the plan (counted with the parameters).
    made_at = {key: (i, nbytes) for key, (i, nbytes) in made.items() if nodes[i].op != "placeholder"}
    for key, (i, nbytes) in made_at.items():
        if key in saved_storages:
            kept[i] += nbytes
    delta = [0] * (len(nodes) + 1)  # bytes live across the gap after node i, by difference array
    for key, (start, nbytes) in made_at.items():
        end = last_use.get(key, start)
        if end > start:
            delta[start] += nbytes
            delta[end] -= nbytes
    live_after, running = [], 0
    for i in range(len(nodes)):
        running += delta[i]
        live_after.append(running)
    flops = [ops.flops(n, gm) if n.op.startswith("call") else 0 for n in nodes]
    ok = [recomputable(n, gm) is None for n in nodes]
    sel = [facts.policy_bytes.get(n.name, 0) for n in nodes]
    sel_flops = [f if b else 0 for f, b in zip(flops, sel)]
    return nodes, kept, live_after, flops, ok, sel, sel_flops


@register
class Recompute(Pass):
    """Recompute the cheapest activations in backward so a training step fits budget_gb."""

    name = "recompute"
    options = {
        "budget_gb": Option(None, _positive, "peak memory of one training step, in GB of 10**9 bytes"),
        # The estimate is within a few percent of a measured step, not exact: plans aim below.
        "headroom": Option(0.05, _fraction, "fraction of the budget kept free for estimate error, in [0, 0.5)"),
    }

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        budget_gb = self.settings["budget_gb"]
        if budget_gb is None:
            raise BudgetError("the recompute pass needs budget_gb, e.g. recompute{budget_gb=8}.")
        budget = int(budget_gb * GB * (1 - self.settings["headroom"]))
        inputs = ctx.flat_inputs(gm)
        # Step 1
        before = estimate_peak(gm, inputs)
        stats = {"budget_bytes": int(budget_gb * GB), "planned_for_bytes": budget, "peak_before_bytes": before.peak_bytes}
        if not ctx.train:
            if before.peak_bytes > budget:
                raise self._error(budget_gb, before.peak_bytes, before.breakdown, inference=True)
            return PassResult(gm, False, {**stats, "predicted_peak_bytes": before.peak_bytes})
        if before.peak_bytes <= budget:
            return PassResult(gm, False, {**stats, "predicted_peak_bytes": before.peak_bytes, "segments": 0})
        # Step 2
        if _hoist_state_writes(gm):
            gm.recompile()
        facts = record_step(gm, inputs)
        nodes, kept, live_after, flops, ok, sel, sel_flops = _node_facts(gm, facts)
        atoms = make_atoms(kept, live_after, flops, ok, sel, sel_flops)
        # Step 3
        candidates = _candidates(atoms)

        # Steps 4 and 5: the solver's model proposes, the full estimate decides.
        def rewrite(plan):
            checkpoint_segments(gm, [nodes[s.start:s.stop] for s in plan.segments],
                                [s.selective for s in plan.segments])
            annotate(gm, inputs)

        def undo():
            inline_segments(gm)
            annotate(gm, inputs)
            nodes[:] = list(gm.graph.nodes)  # the inlined copies, in the same order

        estimates = {}

        def fits(k: int) -> bool:
            if k not in estimates:
                rewrite(candidates[k])
                estimates[k] = estimate_peak(gm, inputs)
                undo()
            return estimates[k].peak_bytes <= budget

        if not candidates or not fits(len(candidates) - 1):
            smallest = min(estimates.values(), key=lambda e: e.peak_bytes, default=before)
            raise self._error(budget_gb, smallest.peak_bytes, smallest.breakdown, inference=False)
        lo, hi = 0, len(candidates) - 1  # candidates[hi] fits
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
        # The estimate falls with FLOPs only roughly: a few cheaper plans get their own look.
        for k in range(hi - 1, max(hi - 1 - LOOK_BELOW, -1), -1):
            hi = k if fits(k) else hi
        plan, last = candidates[hi], estimates[hi]
        peak = last.peak_bytes
        decision = {}
        for s in plan.segments:
            for n in nodes[s.start:s.stop]:
                decision[n] = "kept" if s.selective and facts.policy_bytes.get(n.name) else "recomputed"
        for n in nodes:  # before the rewrite: segment copies share these notes
            if n.op.startswith("call"):
                note(n, "recompute", decision.get(n, "kept"))
        rewrite(plan)
        # Step 6
        for n in gm.graph.nodes:
            if isinstance(n.target, RecomputeSegment):
                note(n, "recompute", f"segment {n.target.index}")
                for i in n.all_input_nodes:
                    if i.op.startswith("call"):
                        note(i, "recompute", "boundary")
        # The plan fits the budget for these shapes; other shapes would run correctly but
        # could exceed it, so the result asks for the planned shapes (the lazy form re-plans).
        ctx.facts["shape_specialized"] = f"its recompute plan fits budget_gb={budget_gb:g} for them"
        step_flops = 3 * sum(flops)  # forward + backward, about twice the forward
        return PassResult(gm, True, {
            **stats,
            "predicted_peak_bytes": peak,
            "segments": len(plan.segments),
            "selective_segments": sum(s.selective for s in plan.segments),
            "recomputed_nodes": sum(v == "recomputed" for v in decision.values()),
            "recompute_flops": plan.recompute_flops,
            "recompute_overhead_pct": round(100 * plan.recompute_flops / max(step_flops, 1), 1),
        })

    def _error(self, budget_gb: float, minimum: int, breakdown: dict, inference: bool) -> BudgetError:
        minimum = int(minimum / (1 - self.settings["headroom"]))
        parts = {k: v for k, v in breakdown.items() if v}
        detail = ", ".join(f"{k} {v / GB:.3f} GB" for k, v in parts.items())
        what = "the forward pass (inference: nothing to recompute)" if inference else "one training step"
        return BudgetError(
            f"budget_gb={budget_gb:g} is below the {minimum / GB:.3f} GB that {what} needs at least "
            f"({detail}). Raise budget_gb to {minimum / GB:.3f} or more, halve activations with "
            "precision='bf16', or split the model over devices with stages=N.",
            min_budget_gb=minimum / GB, breakdown=parts,
        )

