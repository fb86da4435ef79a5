"""Choose recompute segments: the least recompute FLOPs whose predicted peak fits a budget.

A Chen-style plan: the graph order is cut into segments; a checkpointed segment keeps only
the tensors that cross into it during the forward, and in its backward runs again, holding
what it saves for as long as its own backward takes. With

    base      parameters, buffers, inputs, optimizer state, parameter gradients
    kept(s)   bytes a segment saves for backward when it is not checkpointed
    cross(s)  bytes live across the segment's start (every tensor made before it and used in
              or after it: skip connections count)
    T         the largest rerun(s) among checkpointed segments: kept(s) saved again in its
              backward, plus its largest gradient and one workspace of that size

the peak is about base + sum(kept, plain segments) + sum(cross, checkpointed) + T.

Algorithm:
  1. Atoms: cut the node order where few bytes cross (at most `max_cuts` cut points, chosen
     by crossing bytes) and around every node that cannot be recomputed.
  2. For each candidate T (the distinct rerun() values of recomputable runs, thinned):
     a knapsack DP over atoms, memory in `buckets` steps of the allowance budget - base - T
     (each use rounded up: plans never exceed the allowance, at worst recompute a little
     more than the optimum), minimizing recompute FLOPs; a run of recomputable atoms with
     rerun <= T may be one checkpointed segment.
  3. Keep the feasible plan of least FLOPs (ties: least predicted peak). Deterministic: the
     same graph and budget give the same plan.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Atom:
    start: int          # first node index
    stop: int           # one past the last node index
    kept: int           # bytes its nodes save for backward when it is not checkpointed
    cross: int          # bytes live across its start
    flops: int          # recompute cost
    recomputable: bool
    grad: int = 0       # largest gradient of its nodes' outputs


@dataclass
class Plan:
    segments: list[tuple[int, int]]   # (start, stop) node index ranges to checkpoint
    recompute_flops: int
    predicted_peak: int               # by the model above

    @property
    def feasible(self) -> bool:
        return self.predicted_peak >= 0


def make_atoms(kept: list[int], live_after: list[int], flops: list[int], recomputable: list[bool],
               grads: list[int] | None = None, max_cuts: int = 96) -> list[Atom]:
    """Group per-node facts into atoms. live_after[i]: bytes made before node i+1 and used after i;
    grads[i]: bytes of the gradient of node i's output."""
    grads = grads or [0] * len(kept)
    n = len(kept)
    forced = {0, n}
    for i, ok in enumerate(recomputable):
        if not ok:
            forced.update((i, i + 1))
    free_cuts = sorted((live_after[i - 1], i) for i in range(1, n) if i not in forced)
    cuts = sorted(forced | {i for _, i in free_cuts[:max_cuts]})
    atoms = []
    for a, b in zip(cuts, cuts[1:]):
        atoms.append(Atom(a, b, sum(kept[a:b]), live_after[a - 1] if a else 0, sum(flops[a:b]),
                          all(recomputable[a:b]), max(grads[a:b], default=0)))
    return atoms


def solve(atoms: list[Atom], allowance: int, buckets: int = 256, max_caps: int = 24) -> Plan | None:
    """The least-FLOPs plan whose predicted activation memory fits `allowance` bytes; None if none does."""
    if not atoms:
        return Plan([], 0, 0)
    total_kept = sum(a.kept for a in atoms)
    if total_kept <= allowance:
        return Plan([], 0, total_kept)
    runs = _recomputable_runs(atoms)
    caps = sorted({rerun(atoms[i:j]) for r0, r1 in runs for i in range(r0, r1) for j in range(i + 1, r1 + 1)})
    if len(caps) > max_caps:
        caps = [caps[round(k * (len(caps) - 1) / (max_caps - 1))] for k in range(max_caps)]
    best: Plan | None = None
    for cap in caps:
        plan = _solve_with_cap(atoms, allowance - cap, cap, buckets)
        if plan and (best is None or (plan.recompute_flops, plan.predicted_peak) < (best.recompute_flops, best.predicted_peak)):
            best = plan
    return best


def rerun(atoms: list[Atom]) -> int:
    """Bytes a checkpointed segment holds while its backward runs: what it saves again, plus
    its largest gradient and one workspace of that size."""
    return sum(a.kept for a in atoms) + 2 * max((a.grad for a in atoms), default=0)


def _recomputable_runs(atoms: list[Atom]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, a in enumerate(atoms + [Atom(0, 0, 0, 0, 0, False)]):
        if a.recomputable and start is None:
            start = i
        elif not a.recomputable and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _solve_with_cap(atoms: list[Atom], room: int, cap: int, buckets: int) -> Plan | None:
    """Knapsack DP: memory in units of room/buckets bytes, each use rounded up, so a plan always
    fits; with room <= buckets a unit is one byte and the DP is exact."""
    if room <= 0:
        return None
    buckets = int(min(buckets, room))
    unit = room / buckets
    inf = np.iinfo(np.int64).max // 4
    n = len(atoms)
    # cost[i][m]: least FLOPs covering atoms[:i] with m memory units used; choice[i][m] how.
    cost = np.full((n + 1, buckets + 1), inf, dtype=np.int64)
    choice = np.full((n + 1, buckets + 1, 2), -1, dtype=np.int64)  # (previous atom index, checkpointed 0/1)
    cost[0, 0] = 0
    for i in range(n):
        row = cost[i]
        if row.min() >= inf:
            continue
        # Atom i kept as it is.
        _relax(cost, choice, i, i + 1, row, int(np.ceil(atoms[i].kept / unit - 1e-9)), 0, 0)
        # Atoms i..j-1 checkpointed as one segment.
        if atoms[i].recomputable:
            kept = flops = grad = 0
            for j in range(i + 1, n + 1):
                if not atoms[j - 1].recomputable:
                    break
                kept += atoms[j - 1].kept
                flops += atoms[j - 1].flops
                grad = max(grad, atoms[j - 1].grad)
                if kept + 2 * grad > cap:  # grows with j: no longer segment fits either
                    break
                _relax(cost, choice, i, j, row, int(np.ceil(atoms[i].cross / unit - 1e-9)), flops, 1)
    final = cost[n]
    if final.min() >= inf:
        return None
    m = int(np.argmin(final))  # least FLOPs; argmin takes the least memory among ties
    flops_total = int(final[m])
    segments, i = [], n
    while i > 0:
        prev, ckpt = choice[i, m]
        if ckpt:
            segments.append((atoms[prev].start, atoms[i - 1].stop))
        m -= _units_used(atoms, prev, i, ckpt, unit)
        i = int(prev)
    segments.reverse()
    used = sum(a.kept for a in atoms) - sum(a.kept for s in segments for a in atoms if s[0] <= a.start < s[1])
    used += sum(next(a.cross for a in atoms if a.start == s[0]) for s in segments)
    return Plan(segments, flops_total, used + (cap if segments else 0))


def _units_used(atoms, prev, i, ckpt, unit) -> int:
    if ckpt:
        return int(np.ceil(atoms[prev].cross / unit - 1e-9))
    return int(np.ceil(atoms[prev].kept / unit - 1e-9))


def _relax(cost, choice, i, j, row, units, flops, ckpt):
    if units > row.shape[0] - 1:
        return
    shifted = np.full_like(row, np.iinfo(np.int64).max // 4)
    shifted[units:] = row[: row.shape[0] - units] + flops
    better = shifted < cost[j]
    cost[j] = np.where(better, shifted, cost[j])
    choice[j][better] = (i, ckpt)
