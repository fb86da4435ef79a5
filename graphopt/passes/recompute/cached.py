"""The recompute pass through the plan cache (plan_cache/): a plan made once for a graph and its
settings is replayed by later processes, not searched again.

Keyed by plan_cache/key.py (the graph node by node, its state, the versions) and the pass's
settings, the example's mode and the pipeline's. An entry is one of three outcomes: the step
fits as it is; a plan (its segments as node positions, whether each is selective, and each
node's decision, with the node names it was made on); or a refusal (BudgetError's message,
least budget, breakdown and headroom, raised again as it was). A replay checks the entry's
node names against the graph's; where they differ, or the entry is not what this code writes,
it is a miss and the pass plans again. Not cached: a plan that measures (profile, calibrate),
one per rank (world_size), one for CUDA graphs, a chunked loss head's, and any run that dumps
(the dumps show the search, which a replay does not make). The ops the plan writes in place
(step 6) are kept by name and written again, each into aten's in-place twin of its op.
"""
from __future__ import annotations

import hashlib
from typing import Callable

import torch.fx

from ... import ops
from ...analysis.optimizer_memory import OptimizerMemory
from ...errors import BudgetError, BudgetWarning, warn
from ...ops.twins import inplace_call
from ...plan_cache.key import environment_key, graph_key
from ...plan_cache.store import digest
from ..base import PassContext, PassResult
from ..inplace import write_in_place, written_as
from ..notes import note
from ..records import BudgetFit, idle_budget
from .rewrite import checkpoint_segments, note_segments
from .tidy import attributes_first, hoist_state_writes

KIND = "recompute"


def cached_plan(pass_, gm: torch.fx.GraphModule, ctx: PassContext, plan: Callable) -> PassResult:
    """plan(gm, ctx), or its outcome replayed from ctx.plan_cache where an entry for gm's key is."""
    store = ctx.plan_cache
    if store is None or not _cacheable(pass_, ctx):
        return plan(gm, ctx)
    name = digest([KIND, graph_key(gm), environment_key(), repr(pass_.settings), _context_key(ctx)])
    with store.planning(name):  # another rank planning this graph: wait for its entry
        entry = store.get(name, KIND)
        if entry is not None:
            replayed = _replay(pass_, gm, ctx, entry)
            if replayed is not None:
                return replayed
        try:
            result = plan(gm, ctx)
        except BudgetError as e:
            if pass_.cacheable:
                store.put(name, KIND, {"outcome": "refused", "message": str(e), "least": e.min_budget_bytes,
                                       "breakdown": e.breakdown, "headroom": e.headroom})
            raise
        if pass_.cacheable:
            store.put(name, KIND, _payload(pass_, result))
        result.stats["plan_cache"] = "planned and kept"
        return result


def _cacheable(pass_, ctx: PassContext) -> bool:
    s = pass_.settings
    return ctx.train and not (s.profile or s.calibrate or s.world_size or ctx.cuda_graphs)


def _context_key(ctx: PassContext) -> list:
    return [ctx.train, ctx.microbatches, ctx.staged, ctx.units, ctx.writes_in_place, str(ctx.compute_dtype)]


def _names(nodes) -> str:
    return hashlib.sha256("\n".join(n.name for n in nodes).encode()).hexdigest()


def _payload(pass_, result: PassResult) -> dict:
    fit = result.budget
    stats = {k: v for k, v in result.stats.items() if k != "plan_cache"}
    payload = {"outcome": "fits", "stats": stats, "changed": result.changed,
               "fit": [fit.budget_bytes, fit.planned_for_bytes, fit.peak_before_bytes, fit.predicted_peak_bytes],
               "peak": result.peak_bytes, "idle": idle_budget(fit),
               "optimizer": None if pass_.optimizer is None else [pass_.optimizer.state_bytes, pass_.optimizer.step_bytes]}
    if pass_.chosen is not None:
        plan, decisions = pass_.chosen
        nodes = pass_.planned_nodes
        payload.update(outcome="plan", names=_names(nodes), count=len(nodes), decisions=decisions,
                       segments=[[s.start, s.stop, bool(s.selective)] for s in plan.segments])
    return payload


def _rewrites(gm: torch.fx.GraphModule, written: dict) -> list | None:
    """The in-place rewrites of the nodes named in `written` ({name: "op -> op_"}), in graph order;
    None where one is not there or has no in-place twin now."""
    by_name = {n.name: n for n in gm.graph.nodes}
    position = {name: k for k, name in enumerate(by_name)}
    rewrites = []
    for name in sorted(written, key=lambda k: position.get(k, -1)):
        n = by_name.get(name)
        op = ops.lookup(n, gm) if n is not None else None
        bound = ops.bind(n, gm) if op is not None else None
        call = inplace_call(bound) if bound is not None else None
        if call is None or written_as(op) != written[name]:
            return None
        rewrites.append((n, op, call))
    return rewrites


def _replay(pass_, gm: torch.fx.GraphModule, ctx: PassContext, entry: dict) -> PassResult | None:
    """The entry's outcome on gm; None (a miss) where it does not match gm or is not well formed."""
    try:
        outcome = entry["outcome"]
        if outcome == "refused":
            raise BudgetError(str(entry["message"]), int(entry["least"]), dict(entry["breakdown"]),
                              float(entry["headroom"]), pass_.settings.budget_bytes)
        fit = BudgetFit(*[int(v) for v in entry["fit"]])
        stats, peak = dict(entry["stats"]), int(entry["peak"])
        segments = [(int(a), int(b), bool(c)) for a, b, c in entry.get("segments", [])]
        decisions = [str(d) for d in entry.get("decisions", [])]
        known = entry.get("optimizer")
        optimizer = None if known is None else OptimizerMemory(int(known[0]), int(known[1]))
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    if outcome not in ("fits", "plan") or (optimizer is None) != (pass_.settings.optimizer is None):
        return None
    # the pass's own step 1 tidying, as planning did it before deciding
    if attributes_first(gm) + hoist_state_writes(gm):
        gm.recompile()
    # everything checked before the graph changes: a miss plans on the graph as traced
    nodes = list(gm.graph.nodes)
    if outcome == "plan" and (entry.get("count") != len(nodes) or entry.get("names") != _names(nodes)
                              or len(decisions) != len(nodes)
                              or not all(0 <= a < b <= len(nodes) for a, b, _ in segments)
                              or any(b > a2 for (_, b, _), (a2, _, _) in zip(segments, segments[1:]))):
        return None
    written = stats.get("written_in_place") or {}
    rewrites = _rewrites(gm, written) if isinstance(written, dict) else None
    if rewrites is None:
        return None
    if rewrites:
        write_in_place(gm, rewrites)  # each node replaced where it stands, under its name
        nodes = list(gm.graph.nodes)
    if outcome == "plan":
        for n, decision in zip(nodes, decisions):
            if n.op.startswith("call"):
                note(n, "recompute", decision)
        checkpoint_segments(gm, [nodes[a:b] for a, b, _ in segments], [sel for _, _, sel in segments])
        note_segments(gm)
    if entry.get("idle"):
        warn(str(entry["idle"]), BudgetWarning)
    _, target = pass_.setup(gm, ctx, optimizer)
    stats["plan_cache"] = "from the cache"
    check = pass_.budget_check(target, ctx)
    return PassResult(gm, bool(entry.get("changed", True)), stats, call_checks=[check], budget=fit, peak_bytes=peak)
