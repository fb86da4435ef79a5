"""Where each storage of one estimated training step lives, by position in the step.

estimate_peak's instrument (live_storage.py) counts every storage in and out; with this log
each change has a position (its index), and the step's landmarks are positions too: where each
graph node's forward starts, where each autograd node a graph node made starts its backward.
A plan that reruns part of the forward in backward changes when some storages go and adds a
rerun's storages; the log is what lets passes/recompute/pricing.py price such a plan without
running the step again.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch.fx

from .live_storage import Stored


@dataclass
class StepLog:
    deltas: list[int] = field(default_factory=list)     # bytes counted in (+) or out (-) at each position
    storages: list[Stored] = field(default_factory=list)
    forward_start: dict[str, int] = field(default_factory=dict)   # graph node -> position its forward starts
    outputs: dict[str, list[int]] = field(default_factory=dict)   # graph node -> storages of its outputs it made
    backward_marks: list[int] = field(default_factory=list)       # every autograd node's start, in the order they ran
    backward_starts: dict[str, list[int]] = field(default_factory=dict)  # graph node -> its autograd nodes' marks (indices)
    forward_end: int = 0               # position after the forward and the frees of its outputs

    def finish(self, timeline: list[tuple[str, int]], storages: list[Stored]) -> None:
        """Take the instrument's timeline (live bytes after each change) and storages."""
        live, self.deltas = 0, []
        self.storages = [dataclasses.replace(s) for s in storages]  # a copy: what goes after the step is not in it
        for _, after in timeline:
            self.deltas.append(after - live)
            live = after

    def backward_node_started(self, node: str, position: int) -> None:
        self.backward_starts.setdefault(node, []).append(len(self.backward_marks))
        self.backward_marks.append(position)


def forward_made(log: StepLog, nodes: list[torch.fx.Node]) -> dict[str, list[int]]:
    """Per graph node, every storage counted in while its forward ran, in order: its outputs,
    what its kernels keep for backward, and its temporaries."""
    made: dict[str, list[int]] = {n.name: [] for n in nodes}
    for s, stored in enumerate(log.storages):
        phase, _, name = stored.event.partition(" ")
        if phase == "forward" and name in made:
            made[name].append(s)
    return made
