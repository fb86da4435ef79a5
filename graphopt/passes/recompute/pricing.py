"""A recompute plan's peak, priced from the log of one step of the graph without it.

A fake step per plan looked at (memory.estimate_peak) is what made planning slow: thousands of
kernels' dispatch each time. The step without a plan was run once with its log
(analysis/step_log.py: every storage's position in and out, each node's forward start, each
autograd node's backward start); a plan changes that step in two ways, both priced here:

  1. A storage made in the forward and held for backward only by nodes the plan checkpoints
     goes at its last use in the forward; one a checkpoint reads but made outside it is held
     until that checkpoint's backward is done (non-reentrant checkpoint saves its inputs).
     Storages held by a node outside every segment, or kept by a selective segment's policy,
     keep their place.
  2. When the backward first reaches a segment node that saved something, the segment runs
     again up to where its rerun stops (solver.rerun_end): each storage its nodes made in the
     forward is made again, a temporary gone where it went, what a segment node saved held
     until that node's backward is done, anything else gone after its last use in the rerun.

Everything else (parameters, inputs, gradients, the optimizer) stays where the log put it.
This is a model of torch.utils.checkpoint, not a run of it: the recompute pass confirms the
plan it picks with a fake step, and takes that step's word.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.fx

from ...analysis.saved import SAVES_OWN, StepFacts
from ...analysis.segments import keeps_output
from ...analysis.step_log import StepLog, forward_made
from .solver import rerun_end

BEFORE_MARK = 0.9  # a free priced at a landmark lands just before it (keys: position - this)


@dataclass(frozen=True)
class _Made:
    """A storage one graph node made in the forward."""
    serial: int
    node: int           # index of its maker
    output: bool        # of the node's outputs (else a tensor its kernel made)
    held: bool          # alive into the backward in the step without a plan
    temporary: bool     # neither: gone before the next node's forward
    kept: bool          # made by an op a selective segment keeps the output of (segments.keeps_output)


class PlanPricer:
    """price(segments) -> the step's peak bytes with those segments checkpointed."""

    def __init__(self, log: StepLog, facts: StepFacts, nodes: list[torch.fx.Node], saves: list[int]):
        self.log, self.nodes, self.saves = log, nodes, saves
        self.index = {n.name: i for i, n in enumerate(nodes)}
        self.deltas = np.asarray(log.deltas, dtype=np.int64)
        self.positions = np.arange(len(self.deltas), dtype=np.float64)
        starts = [log.forward_start.get(n.name) for n in nodes]
        # where node i's forward is over: the next node's start (its inputs' frees come before it)
        self.forward_end = [log.forward_end] * len(nodes)
        following = log.forward_end
        for i in range(len(nodes) - 1, -1, -1):
            self.forward_end[i] = following
            if starts[i] is not None:
                following = starts[i]
        self.made: list[list[_Made]] = [[] for _ in nodes]
        for name, serials in forward_made(log, nodes).items():
            i = self.index[name]
            outputs = set(log.outputs.get(name, ()))
            for s in serials:
                out = log.storages[s].gone_at
                held = out is None or out >= log.forward_end
                temporary = not held and s not in outputs and out < self.forward_end[i]
                op = log.storages[s].op
                self.made[i].append(_Made(s, i, s in outputs, held, temporary, op is not None and keeps_output(op)))
        self._holders(facts)

    def _holders(self, facts: StepFacts) -> None:
        """Per node: the nodes whose backward saved its outputs, the last node reading them in
        the forward, and every node reading them (a segment among those holds them as its input)."""
        n = len(self.nodes)
        self.savers: list[set[int]] = [set() for _ in range(n)]
        for name, items in facts.saved.items():
            j = self.index.get(name)
            for s in items:
                if j is not None and s.source == "node" and s.owner in self.index:
                    self.savers[self.index[s.owner]].add(j)
        made, last = facts.lifetimes(self.nodes)
        self.last_use = list(range(n))
        self.readers: list[set[int]] = [set() for _ in range(n)]
        maker = {key: i for key, (i, _) in made.items()}
        for node in self.nodes:
            for m in node.all_input_nodes:
                for key, _ in facts.storages.get(m.name, []):
                    if key in maker:
                        self.readers[maker[key]].add(self.index[node.name])
        for key, (i, _) in made.items():
            self.last_use[i] = max(self.last_use[i], last.get(key, i))

    def _backward_start(self, j: int) -> int | None:
        marks = self.log.backward_starts.get(self.nodes[j].name)
        return self.log.backward_marks[min(marks)] if marks else None

    def _released(self, j: int) -> float:
        """Where what node j's backward saved is gone: when the autograd node after its last starts
        (marks in the order they ran: several can start at one position)."""
        marks = self.log.backward_starts.get(self.nodes[j].name)
        following = max(marks) + 1 if marks else len(self.log.backward_marks)
        at = self.log.backward_marks[following] if following < len(self.log.backward_marks) else len(self.deltas)
        return at - BEFORE_MARK

    def _forward_gone(self, i: int) -> float:
        return self.forward_end[i] - BEFORE_MARK

    def price(self, segments) -> int:
        """Peak bytes of the step with `segments` (solver.Segment: start, stop, selective)."""
        keys, deltas = self.changes(segments)
        return int(np.cumsum(deltas[np.argsort(keys, kind="stable")]).max(initial=0))

    def changes(self, segments) -> tuple[np.ndarray, np.ndarray]:
        """Every change of the step with `segments`: (keys, bytes), the step's order the keys' order."""
        seg_of = {}
        for k, s in enumerate(segments):
            for i in range(s.start, s.stop):
                seg_of[i] = k
        released = {}  # segment -> where its backward is done (it releases its inputs)

        def segment_released(k: int) -> float:
            if k not in released:
                s = segments[k]
                ran = [j for j in range(s.start, s.stop) if self.nodes[j].name in self.log.backward_starts]
                released[k] = max(map(self._released, ran)) if ran else len(self.deltas) - BEFORE_MARK
            return released[k]

        def holds_inputs(k: int) -> bool:
            # checkpoint's record of its inputs lives as long as something saved inside it does
            return any(self.saves[j] for j in range(segments[k].start, segments[k].stop))

        deltas = self.deltas.copy()
        keys, extra = [], []
        # 1. frees that move
        for i, made in enumerate(self.made):
            home = seg_of.get(i)
            for m in made:
                inputs_of = ({seg_of[r] for r in self.readers[i] if r in seg_of and holds_inputs(seg_of[r])} - {home}
                             if m.output else ())
                # a selective segment keeps what its policy saves until its rerun takes it back
                cached = home is not None and segments[home].selective and m.kept
                if not m.held and not inputs_of and not cached:
                    continue
                holders = self.savers[i] if m.output and m.held else {i} if m.held else ()
                moved, kept_by, inputs_kept = False, [], []
                for j in holders:
                    k = seg_of.get(j)
                    if k is None or (k == home and cached):
                        kept_by.append(self._released(j))
                    elif k == home:
                        moved = True
                    else:
                        inputs_kept.append(segment_released(k))
                for k in inputs_of:  # the checkpoint keeps its inputs
                    inputs_kept.append(segment_released(k))
                    moved = True
                nbytes, out = self.log.storages[m.serial].nbytes, self.log.storages[m.serial].gone_at
                if cached and not m.held:
                    at = self._rerun_at(segments[home])
                    if at is None:  # nothing inside saves: no rerun, and no cache past the forward
                        continue
                    if out is not None:
                        deltas[out] += nbytes
                    if i < rerun_end(self.saves, segments[home].start, segments[home].stop):
                        continue  # the rerun lets go of it after its last reader there (_rerun)
                    keys.append(at - 0.25)  # past where the rerun stops: the cache goes with the rerun
                    extra.append(-nbytes)
                    continue
                if not moved:
                    continue
                if out is not None:
                    deltas[out] += nbytes
                gone = self._forward_gone(self.last_use[i] if m.output else i)
                went = len(self.deltas) if out is None else out
                if kept_by:  # where the last of those holders lets go; no later than it went before
                    gone = max(gone, min(max(kept_by), went))
                if went > max([gone, *map(self._released, holders)]) + 1:
                    gone = went  # held by something no node's backward explains (a returned tensor): as before
                keys.append(max([gone, *inputs_kept]))
                extra.append(-nbytes)
        # 2. reruns
        for k, s in enumerate(segments):
            self._rerun(k, s, keys, extra, seg_of)
        return (np.concatenate([self.positions, np.asarray(keys, dtype=np.float64)]),
                np.concatenate([deltas, np.asarray(extra, dtype=np.int64)]))

    def _rerun_at(self, s) -> int | None:
        """Where segment s runs again: when the backward first unpacks what one of its nodes saved."""
        triggers = [p for j in range(s.start, s.stop) if self.saves[j] and (p := self._backward_start(j)) is not None]
        return min(triggers) if triggers else None

    def _rerun(self, k: int, s, keys: list, extra: list, seg_of: dict) -> None:
        end, at = rerun_end(self.saves, s.start, s.stop), self._rerun_at(s)
        if end == s.start or at is None:
            return
        # the rerun's changes (forward position, storage, bytes), in the forward's order; what a
        # selective segment keeps is not made again
        changes = []
        for i in range(s.start, end):
            # the rerun takes back what its policy kept (no bytes made) and lets go of it where it
            # would go had it been made again
            changes += [(self.log.storages[m.serial].made_at, m, 0) for m in self.made[i] if s.selective and m.kept and not m.held]
            made = [m for m in self.made[i] if not (s.selective and m.kept)]
            if i == end - 1 and self.saves[i] == SAVES_OWN:
                # the rerun stops once the last saved tensor is saved again: inside this node's kernel
                needed = [n for n, m in enumerate(made) if m.held and (
                    not m.output or any(s.start <= j < s.stop for j in self.savers[i]))]
                last = max(needed, default=len(made) - 1)
                made = made[:last + 1]
            for m in made:
                stored = self.log.storages[m.serial]
                changes.append((stored.made_at, m, stored.nbytes))
                if m.temporary:
                    changes.append((stored.gone_at, m, -stored.nbytes))
        changes.sort(key=lambda c: c[0])
        # squeezed between positions at - 1 and at, where the backward first unpacks what the segment saved
        slot, node_end = {}, {}
        for rank, (_, m, nbytes) in enumerate(changes):
            key = at - 0.75 + 0.5 * (rank + 1) / (len(changes) + 2)
            keys.append(key)
            extra.append(nbytes)
            if nbytes >= 0:
                slot[m.serial] = node_end[m.node] = key
        for _, m, nbytes in changes:
            if nbytes < 0 or m.temporary:
                continue
            nbytes = nbytes or self.log.storages[m.serial].nbytes
            holders = self.savers[m.node] if m.output else {m.node}
            inside = [j for j in holders if seg_of.get(j) == k]
            out = self.log.storages[m.serial].gone_at
            if inside and len(inside) == len(holders) and out is not None and out >= self.log.forward_end:
                gone = out  # where the first run's storage went: the same holders let go of it there
            elif inside:
                gone = max(map(self._released, inside))
            else:  # gone after its last reader in the rerun
                readers = [r for r in self.readers[m.node] if s.start <= r < end] if m.output else []
                gone = max([node_end.get(r, slot[m.serial]) for r in readers] + [slot[m.serial]]) + 1e-9
            keys.append(gone)
            extra.append(-nbytes)
