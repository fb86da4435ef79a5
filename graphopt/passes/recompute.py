"""recompute: insert recompute checkpoints so one training step fits budget_gb (GB = 10**9 bytes).

Algorithm:
  1. Estimate the step's peak as it is (memory.estimate_peak). Within budget: nothing to do.
     In inference only the forward runs and recompute cannot help: over budget is an error.
  2. Per node, from one recorded FakeTensor forward (saved.py): the bytes it keeps for
     backward, the bytes live across it, its FLOPs (ops.flops) and whether it may run twice
     (checkpointing.recomputable).
  3. Solve (solver.py) for the least recompute FLOPs whose predicted activations fit the
     budget less the resident part (parameters, buffers, inputs, parameter gradients, the
     largest gradient in flight).
  4. Rewrite the chosen segments through torch.utils.checkpoint (checkpointing.py).
  5. Check the rewritten graph with the full estimate. Over budget: verify the plan for the
     smallest allowance the solver can meet; if even that is over, BudgetError names its
     peak as the smallest budget that works. Otherwise bisect between the two for the
     largest allowance whose plan fits (least recompute).
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
from ..solver import make_atoms, solve
from ..trace import annotate
from .base import Option, Pass, PassContext, PassResult
from .registry import register

BISECTIONS = 6


def _least_allowance(atoms) -> int:
    """Smallest activation allowance the solver can meet, by bisection."""
    lo, hi = 0, sum(a.kept for a in atoms)
    while hi - lo > max(hi // 256, 1):
        mid = (lo + hi) // 2
        if solve(atoms, mid) is None:
            lo = mid
        else:
            hi = mid
    return hi


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


def _node_facts(gm: torch.fx.GraphModule, facts):
    """Per node in graph order: bytes kept for backward, bytes live after it, FLOPs, recomputable."""
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
    grads = [facts.grad_bytes.get(n.name, 0) for n in nodes]
    return nodes, kept, live_after, flops, ok, grads


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
        facts = record_step(gm, inputs)
        nodes, kept, live_after, flops, ok, grads = _node_facts(gm, facts)
        atoms = make_atoms(kept, live_after, flops, ok, grads)
        resident = sum(v for k, v in before.breakdown.items() if k not in ("activations", "gradients", "transient"))
        resident += sum(p.untyped_storage().nbytes() for p in gm.parameters() if p.requires_grad) \
            - before.breakdown.get("parameter gradients", 0)
        resident += 2 * max(facts.grad_bytes.values(), default=0)
        # Steps 3 to 5: the solver's model guides, the full estimate decides.
        def attempt(allowance: int):
            """Plan for `allowance`, rewrite, estimate; returns (plan, peak) and leaves gm rewritten."""
            plan = solve(atoms, allowance) if allowance > 0 else None
            if plan is None:
                return None, None
            nonlocal last
            segment_nodes = {n for a, b in plan.segments for n in nodes[a:b]}
            for n in nodes:  # before the rewrite: segment copies share these notes
                if n.op.startswith("call"):
                    note(n, "recompute", "recomputed" if n in segment_nodes else "kept")
            checkpoint_segments(gm, [nodes[a:b] for a, b in plan.segments])
            annotate(gm, inputs)
            last = estimate_peak(gm, inputs)
            return plan, last.peak_bytes

        def undo():
            inline_segments(gm)
            annotate(gm, inputs)
            nodes[:] = list(gm.graph.nodes)  # the inlined copies, in the same order

        last = before
        high = budget - resident
        plan, peak = attempt(high)
        if peak is None or peak > budget:
            if peak is not None:
                undo()
            low = _least_allowance(atoms)
            plan, peak = attempt(low)
            if peak is None or peak > budget:
                # The smallest plan found, with its own breakdown (before it, the plain step's).
                raise self._error(budget_gb, peak or before.peak_bytes, last.breakdown, inference=False)
            for _ in range(BISECTIONS):  # largest allowance that still fits: least recompute
                mid = (low + high) // 2
                if high - low <= max(high // 64, 1):
                    break
                undo()
                trial, trial_peak = attempt(mid)
                if trial_peak is not None and trial_peak <= budget:
                    low, plan, peak = mid, trial, trial_peak
                else:
                    high = mid
                    undo()
                    plan, peak = attempt(low)
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
            "recomputed_nodes": sum(b - a for a, b in plan.segments),
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

