"""Cut a graph's node order into pipeline stages: least bottleneck cost, then least traffic.

Stage s holds nodes[cuts[s]:cuts[s+1]]. Its cost is the sum of its nodes' costs (forward and
backward); its memory is the parameters it reads (a parameter read by two stages, such as a
tied embedding and LM head, is held by both), their gradients and optimizer state, the
largest backward working set among its nodes (gradients in flight and workspace), plus the
activations its nodes keep for backward times the microbatches in flight on it:

    gpipe             every microbatch: all forwards run before the first backward
    1f1b              min(M, N - s): stage s has started N - s forwards when its first backward runs
    interleaved-1f1b  as 1f1b, over the N x v virtual stages

Algorithm (exact, over every allowed cut position; numpy rows over the previous cut):
  1. best[s][b]: the least bottleneck (largest stage cost) of the first s stages ending at
     position b, with each stage under the memory cap: min over a of max(best[s-1][a], cost(a, b)).
  2. With the optimum B = best[N][n]: traffic[s][b], the least sum of bytes crossing the cuts
     over partitions whose every stage costs at most B (and fits): ties go to fewer bytes.
  3. Walk back through the second table for the cuts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
INF = np.inf


@dataclass
class StageFacts:
    """Per node, in graph order."""

    cost: list[float]            # forward + backward time, in nanoseconds (analysis/cost.step_costs)
    kept: list[int]              # activation bytes its backward needs, per microbatch
    params: list[dict[int, int]]  # parameter storages it reads -> bytes
    cross: list[int]             # bytes crossing a cut just before node i (cross[0] = 0)
    can_cut: list[bool]          # whether a cut just before node i is allowed
    state_factor: float = 2.0    # gradient + optimizer state bytes per parameter byte (Adam: 1 + 2)
    work: list[int] = field(default_factory=list)  # transient bytes of its backward (default: none)


@dataclass
class Partition:
    cuts: list[int]                   # stage s is nodes[cuts[s]:cuts[s+1]]
    stage_cost: list[float]
    stage_memory: list[int] = field(default_factory=list)
    boundary_bytes: list[int] = field(default_factory=list)  # bytes crossing each cut

    @property
    def imbalance(self) -> float:
        """Slowest stage over the mean stage: 1.0 is perfect balance."""
        mean = sum(self.stage_cost) / len(self.stage_cost)
        return max(self.stage_cost) / mean if mean else 1.0

    def bubble(self, microbatches: int) -> float:
        """Predicted idle share of a synchronous schedule: (N - 1) slots of the slowest stage
        over the M microbatches, per the usual (N - 1) / (M + N - 1) with unequal stages."""
        n, slow = len(self.stage_cost), max(self.stage_cost)
        busy = sum(self.stage_cost) * microbatches
        total = n * slow * (microbatches + n - 1)
        return 1.0 - busy / total if total else 0.0


def in_flight(stage: int, stages: int, microbatches: int, schedule: str) -> int:
    if schedule == "gpipe":
        return microbatches
    return min(microbatches, stages - stage)


def partition(facts: StageFacts, stages: int, *, microbatches: int = 1, schedule: str = "1f1b",
              memory_cap: int | None = None) -> Partition | None:
    """The exact partition (None when no partition meets the memory cap)."""
    n = len(facts.cost)
    cost = np.concatenate([[0.0], np.cumsum(np.asarray(facts.cost, dtype=np.float64))])
    kept = np.concatenate([[0], np.cumsum(np.asarray(facts.kept, dtype=np.int64))])
    allowed = np.array([True] + [bool(c) for c in facts.can_cut[1:]] + [True])
    allowed[0] = allowed[n] = True
    cross = np.asarray(list(facts.cross) + [0], dtype=np.float64)
    memory = _Memory(facts, memory_cap, stages, microbatches, schedule, kept)
    # Step 1
    bottleneck = _least_largest(stages, allowed, lambda s, a, b: cost[b] - cost[a], memory.fits)
    if not np.isfinite(bottleneck):
        return None
    # Step 2
    limit = bottleneck * (1 + 1e-12) + 1e-9
    traffic = np.full((stages + 1, n + 1), INF)
    back = np.full((stages + 1, n + 1), -1, dtype=np.int64)
    traffic[0, 0] = 0.0
    for s in range(1, stages + 1):
        for b in range(s, n + 1):
            if not allowed[b] or (s == stages) != (b == n):
                continue
            a = np.arange(s - 1, b)
            ok = allowed[a] & memory.fits(s - 1, a, b) & (cost[b] - cost[a] <= limit)
            values = np.where(ok, traffic[s - 1, a] + np.where(a > 0, cross[a], 0.0), INF)
            k = int(np.argmin(values))
            if np.isfinite(values[k]):
                traffic[s, b], back[s, b] = values[k], a[k]
    # Step 3
    cuts, b = [n], n
    for s in range(stages, 0, -1):
        b = int(back[s, b])
        cuts.append(b)
    cuts.reverse()
    return Partition(cuts, [float(cost[cuts[s + 1]] - cost[cuts[s]]) for s in range(stages)],
                     [memory.of(s, cuts[s], cuts[s + 1]) for s in range(stages)],
                     [int(cross[c]) for c in cuts[1:-1]])


def least_memory(facts: StageFacts, stages: int, *, microbatches: int = 1, schedule: str = "1f1b") -> int:
    """The least memory any partition needs on its fullest stage: the smallest cap that fits."""
    kept = np.concatenate([[0], np.cumsum(np.asarray(facts.kept, dtype=np.int64))])
    allowed = np.array([True] + [bool(c) for c in facts.can_cut[1:]] + [True])
    memory = _Memory(facts, None, stages, microbatches, schedule, kept)
    return int(_least_largest(stages, allowed, memory.bytes, None))


def _least_largest(stages: int, allowed: np.ndarray, value, fits) -> float:
    """min over partitions into `stages` of the largest value(s, a, b) among its stages (stage s
    holds nodes[a:b]), over stages that fits(s, a, b) allows (all when fits is None)."""
    n = len(allowed) - 1
    best = np.full((stages + 1, n + 1), INF)
    best[0, 0] = 0.0
    for s in range(1, stages + 1):
        for b in range(s, n + 1):
            if not allowed[b] or (s == stages) != (b == n):
                continue
            a = np.arange(s - 1, b)
            ok = allowed[a] if fits is None else allowed[a] & fits(s - 1, a, b)
            if ok.any():
                best[s, b] = np.min(np.where(ok, np.maximum(best[s - 1, a], value(s - 1, a, b)), INF))
    return best[stages, n]


class _Memory:
    """Stage memory for every start a before an end b, a row at a time."""

    def __init__(self, facts: StageFacts, cap, stages, microbatches, schedule, kept_prefix):
        self.facts, self.cap, self.stages = facts, cap, stages
        self.microbatches, self.schedule, self.kept = microbatches, schedule, kept_prefix
        self.cross = np.asarray(list(facts.cross) + [0], dtype=np.float64)  # cross[0] = cross[n] = 0
        self.work = np.asarray(list(facts.work) or [0] * len(facts.cost), dtype=np.float64)
        self.reach: list[np.ndarray] = []  # [b][a]: parameter bytes read by nodes[a:b]
        # A parameter counts for a start a when its last use before b is at or after a: keep the
        # bytes at each parameter's latest use so far, summed from the right.
        at = np.zeros(len(facts.cost) + 1)
        latest: dict[int, int] = {}
        for b in range(len(facts.cost) + 1):
            self.reach.append(np.cumsum(at[::-1])[::-1])
            if b < len(facts.cost):
                for key, nbytes in facts.params[b].items():
                    if key in latest:
                        at[latest[key]] -= nbytes
                    at[b] += nbytes
                    latest[key] = b

    def params(self, a: np.ndarray, b: int) -> np.ndarray:
        return self.reach[b][a]

    def bytes(self, stage: int, a: np.ndarray, b: int) -> np.ndarray:
        flight = in_flight(stage, self.stages, self.microbatches, self.schedule)
        activations = (self.kept[b] - self.kept[a]) * flight
        # the largest working set among nodes[a:b], for each start a: a running max from the right
        work = np.append(np.maximum.accumulate(self.work[:b][::-1])[::-1], 0.0)[np.minimum(a, b)]
        # torch.distributed.pipelining keeps a receive buffer per microbatch for each input of a
        # stage and for each gradient of its outputs
        buffers = self.microbatches * (self.cross[a] + self.cross[b])
        return self.params(a, b) * (1 + self.facts.state_factor) + activations + work + buffers

    def fits(self, stage: int, a: np.ndarray, b: int) -> np.ndarray:
        if self.cap is None:
            return np.ones(len(a), dtype=bool)
        return self.bytes(stage, a, b) <= self.cap

    def of(self, stage: int, a: int, b: int) -> int:
        return int(self.bytes(stage, np.array([a]), b)[0])
