"""Choose recompute segments: the least recompute cost whose predicted peak fits a budget.

Cost is time in nanoseconds (analysis/cost.py: estimated, or measured with profile=True): the solver
adds up its nodes' costs, and what each checkpointed segment costs besides (SegmentCost).

The graph order is cut into segments, each kept as it is or checkpointed, fully or
selectively. With

    kept(s)   bytes a segment saves for backward when it is not checkpointed
    cross(s)  bytes live across the segment's start (every tensor made before it and used in
              or after it: skip connections count); a checkpointed segment keeps these
    sel(s)    bytes of its matmul, convolution and attention outputs, which a selective
              checkpoint keeps as well, so that its backward reruns only the cheap ops

A checkpointed segment's rerun stops early: torch.utils.checkpoint ends it once every tensor
the segment saved is saved again. Its nodes after the last one that saves anything do not run,
nor does that node's own kernel when it saves only its inputs (rerun_end): a segment ending
in a convolution or matmul reruns what feeds it, not the product itself. Its recompute
cost counts the nodes that do run.

the forward ends holding prefix(end) = the sum over segments of kept (plain), cross (full) or
cross + sel (selective). The backward runs the segments in reverse. When it reaches segment s,
what the segments after s kept is freed already, and it holds

    grads(s)  the parameter gradients made by the backward of s and every later segment (they
              stay to the optimizer), and the gradient flowing into s, taken as large as what
              crosses its end;

a plain s holds prefix(s) + kept(s) + grads(s); a checkpointed s saves again what it saved
the first time, so it holds prefix(s) + cross(s) + sel(s) + kept(s) + grads(s). The predicted
peak is the largest of these and prefix(end). The parameter gradients are why an early layer
of a convnet, whose activations are large, can set the step's peak in backward. The model
leaves out what every plan holds (parameters, inputs, outputs), so it ranks plans rather
than predicts the step: the caller checks the plans it considers with the full estimate
(analysis/memory.py).

Algorithm:
  1. Atoms: cut the node order where few bytes cross (at most `max_cuts` cut points, chosen
     by crossing bytes) and around every node that cannot be recomputed; an atom keeping more
     than its share of the bytes is split at its cheapest inner cut.
  2. A dynamic program over atoms and prefix memory, in `buckets` units of the allowance
     (what a plain atom holds rounded to the nearest unit, every other use up; with
     allowance <= buckets a unit is a byte and the program is exact): the least recompute
     cost covering the first
     i atoms with m units held. A run of recomputable atoms may be one checkpointed segment,
     full or selective, where its backward fits: m + its rerun <= allowance. A state that
     another state of the same row beats with fewer units held is dropped before its moves
     (every later constraint bounds the units held from above, so it leads to no plan the
     other does not match at least as well); the moves from one row, each to its own row,
     are one vectorised update. Given a bound on the cost (a plan's at a smaller allowance,
     or a guess: twice a plan's at a larger one), the states and moves that cost more are
     dropped: no move lowers a cost, and where no plan is found within it the program runs
     again with the next guess, and at last without. All three only save time: the plan is
     the one the plain program gives.
  3. The plan of least cost, ties broken by least memory. Deterministic: the same graph and
     budget give the same plan.

`fits` answers whether `solve` finds a plan at an allowance with the same moves and rounding
(one class, _Moves, owns them), keeping per atom only the fewest units held: the caller's
bisection for the least allowance.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ...analysis.saved import SAVES_INPUTS, SAVES_OWN

PLAIN, FULL, SELECTIVE = 0, 1, 2
INF = np.iinfo(np.int64).max // 4


@dataclass(frozen=True)
class Atom:
    start: int          # first node index
    stop: int           # one past the last node index
    kept: int           # bytes its nodes save for backward when it is not checkpointed
    cross: int          # bytes live across its start
    cost: int           # recompute cost
    recomputable: bool
    sel: int = 0        # bytes of the outputs a selective checkpoint keeps
    sel_cost: int = 0   # cost of those outputs' nodes, which a selective checkpoint does not rerun
    grads: int = 0      # parameter gradients alive when its backward runs (made by it or later atoms)
    out: int = 0        # bytes live across its end: the gradient flowing into its backward is as large
    ops: int = 0        # aten calls a selective segment's policy sees in it
    lead: int | None = None      # rerun cost when the segment's last saving node is in it: its nodes up
                                 # to that point (rerun_end); None: its whole cost
    lead_sel: int | None = None  # the same less what a selective checkpoint keeps
    saves: bool = True           # a node of it saves something for backward

    def rerun(self, selective: bool) -> int:
        """Its rerun cost when the segment's rerun stops in it."""
        if selective:
            return self.cost - self.sel_cost if self.lead_sel is None else self.lead_sel
        return self.cost if self.lead is None else self.lead


@dataclass(frozen=True)
class SegmentCost:
    """What a checkpointed segment costs beyond rerunning its nodes."""
    fixed: int = 0             # per segment
    per_selective_op: int = 0  # per aten call a selective segment's policy sees


@dataclass(frozen=True)
class Segment:
    start: int          # node index range [start, stop)
    stop: int
    selective: bool


@dataclass
class RecomputePlan:
    segments: list[Segment]
    recompute_cost: int
    predicted_peak: int   # activation bytes by the model above
    matmul_flops: int = 0  # FLOPs of the matmuls, convolutions and attention its reruns run


def rerun_end(saves: list[int], start: int, stop: int) -> int:
    """One past the last node of segment [start, stop) that its rerun runs: a checkpoint's rerun
    stops when the last node that saves anything has saved it, before that node's kernel when
    it saves only its inputs (saves[i]: analysis/saved.py's save points). start when no node
    saves anything: the backward then needs no rerun."""
    for k in range(stop - 1, start - 1, -1):
        if saves[k] == SAVES_OWN:
            return k + 1
        if saves[k] == SAVES_INPUTS:
            return k
    return start


def rerun_cost(cost: list[int], saves: list[int] | None, start: int, stop: int, kept_cost: list[int] | None = None) -> int:
    """What rerunning segment [start, stop) costs: its nodes up to rerun_end, less kept_cost (the
    nodes whose outputs a selective checkpoint keeps); saves None: every node runs."""
    end = stop if saves is None else rerun_end(saves, start, stop)
    return sum(cost[start:end]) - (sum(kept_cost[start:end]) if kept_cost else 0)


def make_atoms(kept: list[int], live_after: list[int], cost: list[int], recomputable: list[bool],
               sel: list[int] | None = None, sel_cost: list[int] | None = None, max_cuts: int = 96,
               param_grads: list[int] | None = None, boundaries=(), ops: list[int] | None = None,
               saves: list[int] | None = None) -> list[Atom]:
    """Group per-node facts into atoms. live_after[i]: bytes made before node i+1 and used after i;
    sel[i], sel_cost[i]: output bytes and cost of node i when a selective checkpoint keeps it;
    param_grads[i]: bytes of the parameter gradients node i's backward makes first;
    boundaries: node indices where an atom starts, besides those chosen here (blocks' starts);
    ops[i]: the aten calls node i makes, each of which a selective segment's policy sees; saves[i]: node i's save point (rerun_end), None
    for a rerun that runs every node."""
    n = len(kept)
    sel, sel_cost = sel or [0] * n, sel_cost or [0] * n
    param_grads, ops = param_grads or [0] * n, ops or [0] * n
    saves = saves or [SAVES_OWN] * n
    forced = {0, n}
    for i, ok in enumerate(recomputable):
        if not ok:
            forced.update((i, i + 1))
    free_cuts = sorted((live_after[i - 1], i) for i in range(1, n) if i not in forced)
    cuts = sorted(forced | set(boundaries) | {i for _, i in free_cuts[:max_cuts]})
    # The cheapest cuts can all fall where little crosses (a network's last, small-resolution
    # stage), leaving its large early activations in one atom: split any atom keeping more than
    # its share at its cheapest inner cut, up to max_cuts more.
    share = sum(kept) / max(max_cuts, 1)
    for _ in range(max_cuts):
        a, b = max(zip(cuts, cuts[1:]), key=lambda ab: sum(kept[ab[0]:ab[1]]))
        inner = [i for i in range(a + 1, b) if i not in forced]
        if sum(kept[a:b]) <= share or not inner:
            break
        cuts = sorted([*cuts, min(inner, key=lambda i: (live_after[i - 1], abs(2 * i - a - b)))])
    made_after = [0] * (n + 1)  # parameter gradients made by the backward of node i or later
    for i in range(n - 1, -1, -1):
        made_after[i] = made_after[i + 1] + param_grads[i]
    return [Atom(a, b, sum(kept[a:b]), live_after[a - 1] if a else 0, sum(cost[a:b]), all(recomputable[a:b]),
                 sum(sel[a:b]), sum(sel_cost[a:b]), made_after[a], live_after[b - 1], sum(ops[a:b]),
                 rerun_cost(cost, saves, a, b), rerun_cost(cost, saves, a, b, sel_cost), any(saves[a:b]))
            for a, b in zip(cuts, cuts[1:])]


def model_peak(atoms: list[Atom], segments: list[tuple[int, int, int]]) -> int:
    """The model's peak for segments given as (first atom, one past the last, FULL | SELECTIVE)."""
    starts = {a: (b, kind) for a, b, kind in segments}
    held = peak = i = 0
    while i < len(atoms):
        if i in starts:
            j, kind = starts[i]
            run = atoms[i:j]
            sel = sum(a.sel for a in run) if kind == SELECTIVE else 0
            peak = max(peak, held + atoms[i].cross + sel + sum(a.kept for a in run) + atoms[i].grads + atoms[j - 1].out)
            held += atoms[i].cross + sel
            i = j
        else:
            held += atoms[i].kept
            peak = max(peak, held + atoms[i].grads + atoms[i].out)
            i += 1
    return max(peak, held)


def solve(atoms: list[Atom], allowance: int, buckets: int = 1024, segment_cost: SegmentCost = SegmentCost(),
          selective: bool = True, bound: int | None = None, floor: int | None = None) -> RecomputePlan | None:
    """The least-cost plan whose predicted activation memory fits `allowance` bytes; None if none does.
    selective False: full segments only. bound: a cost the least is likely within (a plan's at a
    smaller allowance); without one, floor: a cost it likely exceeds (a plan's at a larger
    allowance). Both only save time: the same plan either way."""
    as_is = model_peak(atoms, [])
    if as_is <= allowance:
        return RecomputePlan([], 0, as_is)
    if allowance <= 0:
        return None
    if segment_cost.fixed >= 0 and segment_cost.per_selective_op >= 0 and \
            all(a.cost >= a.sel_cost >= 0 for a in atoms):  # no move lowers a cost: a bound holds
        for guess in _guesses(atoms, bound, floor):
            plan = _solve(atoms, allowance, buckets, segment_cost, selective, guess)
            if plan is not None:
                return plan
    return _solve(atoms, allowance, buckets, segment_cost, selective, None)


def _guesses(atoms: list[Atom], bound: int | None, floor: int | None) -> list[int]:
    """The bounds solve tries before none: the one given, else the floor doubled up to three times
    (the whole cost's 1/32 for none). A bound a little over the least prunes most states, one
    under it costs a pruned program that finds nothing: a guess is cheap where no plan bounds it."""
    if bound is not None:
        return [bound]
    seed = floor if floor else sum(a.cost for a in atoms) // 64
    return [seed * 2 ** t for t in (1, 2, 3)] if seed > 0 else []


def _solve(atoms: list[Atom], allowance: int, buckets: int, segment_cost: SegmentCost, selective: bool,
           bound: int | None) -> RecomputePlan | None:
    """solve's program. With a bound, the states that cost more are dropped: every move costs
    nothing or more, so none of them leads to a plan within the bound, and the states within it
    (the program's every choice among them) are as without it: a plan found is solve's, and where
    none is found the least costs more than the bound."""
    moves = _Moves(atoms, allowance, buckets, segment_cost, selective)
    n, buckets = len(atoms), moves.buckets
    # Step 2. cost[i, m]: least cost covering atoms[:i] holding m units; how[i, m]: (previous i, kind).
    cost = np.full((n + 1, buckets + 1), INF, dtype=np.int64)
    how = np.full((n + 1, buckets + 1, 2), -1, dtype=np.int64)
    cost[0, 0] = 0
    for i in range(n):
        # Only the states no other state beats with fewer units held: every later constraint
        # is an upper bound on units held, so the others lead to no plan these do not match.
        row = cost[i]
        held = np.flatnonzero(row < np.concatenate(([INF], np.minimum.accumulate(row)[:-1])))
        if bound is not None:
            held = held[row[held] <= bound]
        if held.size == 0:
            continue
        for j, add, limit, spent, kind in moves.from_atom(i):
            _relax(cost, how, held, row[held], j, add, limit, spent, (i, kind), bound)
    # Step 3
    final = cost[n]
    if final.min() >= INF or (bound is not None and final.min() > bound):
        return None
    m = int(np.argmin(final))  # least cost; argmin takes the least memory among ties
    cost_total = int(final[m])
    chosen, i = [], n
    while i > 0:
        prev, kind = (int(v) for v in how[i, m])
        if kind == PLAIN:
            m -= moves.held_units(atoms[prev].kept)
        else:
            run_sel = sum(a.sel for a in atoms[prev:i]) if kind == SELECTIVE else 0
            m -= moves.units(atoms[prev].cross + run_sel)
            chosen.append((prev, i, kind))
        i = prev
    chosen.reverse()
    segments = [Segment(atoms[a].start, atoms[b - 1].stop, kind == SELECTIVE) for a, b, kind in chosen]
    return RecomputePlan(segments, cost_total, model_peak(atoms, chosen))


def fits(atoms: list[Atom], allowance: int, buckets: int = 1024) -> bool:
    """Whether solve(atoms, allowance, buckets) finds a plan, without its costs: the same moves,
    keeping per atom only the fewest units held (holding less never fails a later constraint),
    so that bisecting for the least allowance takes a vector per atom instead of a table."""
    if model_peak(atoms, []) <= allowance:
        return True
    if allowance <= 0:
        return False
    moves = _Moves(atoms, allowance, buckets, SegmentCost(), selective=True)
    least = np.full(len(atoms) + 1, INF, dtype=np.int64)
    least[0] = 0
    for i in range(len(atoms)):
        m = least[i]
        if m >= INF:
            continue
        for j, add, limit, _, _ in moves.from_atom(i):
            ok = (m <= limit) & (m + add <= moves.buckets)
            np.minimum.at(least, j[ok], m + add[ok])
    return bool(least[-1] < INF)


class _Moves:
    """The program's moves and its rounding of bytes to units of allowance / buckets: the moves
    in bytes are the atoms' (_table, built once for all allowances), their units this allowance's."""

    def __init__(self, atoms: list[Atom], allowance: int, buckets: int, segment_cost: SegmentCost, selective: bool):
        self.table = _table(tuple(atoms), segment_cost, selective)
        self.buckets = int(min(buckets, allowance))
        self.unit = allowance / self.buckets
        t = self.table
        # a plain atom adds to the units held rounded to nearest, as hundreds of small atoms each
        # rounded up would claim more than the allowance itself; a segment's crossing rounded up
        self.add = np.where(t.kind == PLAIN, self.held_units_of(t.add), self.units_of(t.add))
        self.limit = self.buckets - self.units_of(t.held)

    def units(self, nbytes: int) -> int:
        return int(self.units_of(np.int64(nbytes)))

    def held_units(self, nbytes: int) -> int:
        return int(self.held_units_of(np.int64(nbytes)))

    def units_of(self, nbytes: np.ndarray) -> np.ndarray:
        return np.ceil(nbytes / self.unit - 1e-9).astype(np.int64)

    def held_units_of(self, nbytes: np.ndarray) -> np.ndarray:
        return np.floor(nbytes / self.unit + 0.5).astype(np.int64)

    def from_atom(self, i: int) -> list[tuple]:
        """The moves from having covered atoms[:i], each (j, add, limit, spent, kind) over the rows
        j it reaches: units added to those held, the most units held before it for the step to
        fit, and its cost."""
        t, found = self.table, []
        for kind in (PLAIN, FULL, SELECTIVE):
            a, b = t.groups[i, kind], t.groups[i, kind + 1]
            if a < b:
                found.append((t.j[a:b], self.add[a:b], self.limit[a:b], t.spent[a:b], kind))
        return found


@dataclass(frozen=True)
class _Table:
    """Every move of the program in bytes, one row each, grouped by the atom it leaves and its
    kind (rows groups[i, kind] to groups[i, kind + 1]): the row j it reaches, the bytes it adds
    to those held, the bytes its backward holds besides them, its cost."""
    j: np.ndarray
    add: np.ndarray
    held: np.ndarray
    spent: np.ndarray
    kind: np.ndarray
    groups: np.ndarray


@functools.lru_cache(maxsize=8)
def _table(atoms: tuple[Atom, ...], segment_cost: SegmentCost, selective: bool) -> _Table:
    """The moves from each atom: plain, and a checkpointed segment atoms[i:j], full or (with
    selective) keeping its matmuls' outputs, for each j over the recomputable run from i while
    its backward holds less than the step as it is (no solve looks at a larger allowance)."""
    n = len(atoms)
    as_is = model_peak(list(atoms), [])
    # Per run of atoms [i, j): sums as differences of prefix sums, the rerun up to its last atom
    # that saves anything (saving[j]: that atom's index among atoms[:j], -1 for none).
    prefix = lambda values: np.concatenate(([0], np.cumsum(np.array(values, dtype=np.int64))))  # noqa: E731
    kept_p, cost_p = prefix([a.kept for a in atoms]), prefix([a.cost for a in atoms])
    cost_sel_p, sel_p, ops_p = prefix([a.cost - a.sel_cost for a in atoms]), prefix([a.sel for a in atoms]), \
        prefix([a.ops for a in atoms])
    rerun_full = np.array([a.rerun(False) for a in atoms] + [0], dtype=np.int64)
    rerun_part = np.array([a.rerun(True) for a in atoms] + [0], dtype=np.int64)
    out = np.array([0] + [a.out for a in atoms], dtype=np.int64)  # out[j]: atoms[j - 1]'s
    saving = np.maximum.accumulate(np.array([-1] + [k if a.saves else -1 for k, a in enumerate(atoms)]))
    ends = [n] * n  # one past the last atom of the recomputable run from atoms[i] on
    for i in range(n - 2, -1, -1):
        ends[i] = ends[i + 1] if atoms[i + 1].recomputable else i + 1
    one = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    rows: list[tuple] = []
    groups = np.zeros((n + 1, 4), dtype=np.int64)
    count = 0
    for i, atom in enumerate(atoms):
        moves = {PLAIN: (one(i + 1), one(atom.kept), one(atom.kept + atom.grads + atom.out), one(0))}
        if atom.recomputable:
            j = np.arange(i + 1, ends[i] + 1)
            kept = kept_p[j] - kept_p[i]
            j, kept = (v[:np.searchsorted(atom.cross + kept + atom.grads > as_is, True)] for v in (j, kept))
            last = saving[j]
            runs = last >= i
            rerun = np.where(runs, cost_p[np.maximum(last, i)] - cost_p[i] + rerun_full[last], 0)
            backward = kept + atom.grads + out[j]
            moves[FULL] = (j, np.full_like(j, atom.cross), atom.cross + backward, rerun + segment_cost.fixed)
            if selective:
                rerun_sel = np.where(runs, cost_sel_p[np.maximum(last, i)] - cost_sel_p[i] + rerun_part[last], 0)
                sel = sel_p[j] - sel_p[i]
                some = sel > 0
                j, sel, backward = j[some], sel[some], backward[some]
                moves[SELECTIVE] = (j, atom.cross + sel, atom.cross + sel + backward, rerun_sel[some]
                                    + segment_cost.fixed + segment_cost.per_selective_op * (ops_p[j] - ops_p[i]))
        for kind in (PLAIN, FULL, SELECTIVE):
            groups[i, kind] = count
            if kind in moves:
                rows.append((*moves[kind], kind))
                count += moves[kind][0].size
        groups[i, 3] = count
    groups[n, :] = count
    join = lambda k: np.concatenate([r[k] for r in rows]).astype(np.int64)  # noqa: E731
    kind = np.concatenate([np.full(r[0].size, r[4], dtype=np.int64) for r in rows])
    return _Table(join(0), join(1), join(2), join(3), kind, groups)


def _relax(cost, how, held, spent_now, j, add, limit, spent, how_value, bound=None):
    """For each move k: cost[j[k], m + add[k]] = min(it, spent_now + spent[k]) for the states m in
    held with m <= limit[k] (and the sum within bound), and how there = how_value where that
    lowered it. Each move writes its own row, so one vectorised update does them all."""
    # held is sorted and spent_now falls along it: move k reaches states begin[k] to stop[k]
    width = cost.shape[1]
    stop = np.searchsorted(held, np.minimum(limit, width - 1 - add), side="right")
    begin = 0 if bound is None else np.searchsorted(-spent_now, spent - bound, side="left")
    count = np.maximum(stop - begin, 0)
    total = int(count.sum())
    if total == 0:
        return
    k = np.repeat(np.arange(j.size), count)
    state = np.arange(total) - np.repeat(np.cumsum(count) - count - begin, count)
    at = (j * width + add)[k] + held[state]  # flat indices into cost
    values = spent[k] + spent_now[state]
    flat = cost.reshape(-1)
    better = values < flat[at]
    at = at[better]
    flat[at] = values[better]
    how.reshape(-1, 2)[at] = how_value
