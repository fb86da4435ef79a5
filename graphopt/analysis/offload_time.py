"""What the offloaded segments of a plan (runtime/offload.py) move and what their copies cost a step,
and what the gradients' copies down cost where backward makes them on the host's side
(runtime/host_optimizer.py's move_gradients).

Each offloaded segment's inputs that the graph computes go down to the host when it is called and
come back up for its backward. On CUDA the copies run on streams of their own (runtime/
copy_streams.py): a copy down beside the forward that follows the call, a segment's copy up beside
the backward of the segment after it (which brings it ahead), except the first to come back, which
nothing precedes; a parameter's gradient goes down on the same stream as soon as the backward of its
first reader in the forward is done, beside the rest of the backward. The step waits only where a
copy is not done when its backward begins, and for the gradients where the last of them is not done
when backward ends (the host's step reads them all). The time model plays the step's two timelines
(the step's stream, each node at its estimated seconds, a node's backward twice its forward, a
segment's backward its rerun and twice its forward) against the copies' (each at the host link's
measured rate, down and up each one at a time) and counts the waits. On CPU a copy is made where it
is called: all of it is waited for.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from .cost import forward_costs, rates
from .meta import TensorInfo, tensor_info
from .saved import params_read, storage_key
from .segments import SegmentCall, segment_parameters


@dataclass(frozen=True)
class OffloadTime:
    """Seconds of one step's copies of offloaded inputs, and of its gradients' copies down."""

    copies_s: float  # the offloaded inputs', all of them, down and up
    waited_s: float  # what the step waits for them: the copies' time no compute hides
    gradients_waited_s: float = 0.0  # what it waits for the gradients' copies down after backward


def offloaded_inputs(node: torch.fx.Node) -> int:
    """Bytes an offloaded segment's call copies to the host each step: its inputs that the graph
    computes (runtime/offload.owned: not a parameter, nor the model's input); 0 for any other node."""
    if not (isinstance(node.target, SegmentCall) and node.target.offloaded):
        return 0
    moved = 0
    for i in node.all_input_nodes:
        info = tensor_info(i)
        if i.op.startswith("call") and isinstance(info, TensorInfo) and info.requires_grad:
            moved += info.nbytes
    return moved


def offloaded_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes the offloaded segments of gm copy to the host each step."""
    return sum(offloaded_inputs(n) for n in gm.graph.nodes)


def offload_time(gm: torch.fx.GraphModule, device: str, gradients: bool = False) -> OffloadTime:
    """The copies of gm's offloaded segments in one step on `device` ("cuda" or "cpu"); with
    gradients, each trainable parameter's gradient copied down as backward completes it too."""
    calls = [n for n in gm.graph.nodes if n.op.startswith("call")]
    link = rates(device).host_bytes_per_s
    moved = {n: nbytes / link for n in calls if (nbytes := offloaded_inputs(n))}
    completed = _gradients_completed(gm, calls) if gradients else {}
    copies = 2 * sum(moved.values())
    if device != "cuda":
        return OffloadTime(copies, copies, sum(completed.values()) / link)
    seconds = [_forward_seconds(n, gm, device) for n in calls]
    t = down = 0.0
    stored = {}  # a call -> when its copy down is done
    for n, s in zip(calls, seconds):
        if n in moved:
            down = stored[n] = max(down, t) + moved[n]
        t += s
    computed = t
    up, ready, previous = 0.0, {}, {}
    ordered = [n for n in calls if n in moved]
    previous.update(zip(ordered[1:], ordered[:-1]))
    for n, s in zip(reversed(calls), reversed(seconds)):
        if n in moved:
            if n not in ready:  # the first to come back: nothing brought it ahead
                up = ready[n] = max(up, t, stored[n]) + moved[n]
            t = max(t, ready[n])
            if n in previous:  # brought up while this one reruns and backpropagates
                before = previous[n]
                up = ready[before] = max(up, t, stored[before]) + moved[before]
        backward = (3 if isinstance(n.target, SegmentCall) else 2) * s
        t, computed = t + backward, computed + backward
        if n in completed:  # its parameters' gradients are whole: down beside the rest of backward
            down = max(down, t) + completed[n] / link
    return OffloadTime(copies, t - computed, max(down - t, 0.0) if completed else 0.0)


def _gradients_completed(gm: torch.fx.GraphModule, calls: list[torch.fx.Node]) -> dict[torch.fx.Node, int]:
    """Per call, bytes of the trainable parameters whose gradients its backward completes: those it
    is the first in the forward to read, each storage once."""
    completed, seen = {}, set()
    for n in calls:
        params = segment_parameters(n.target) if isinstance(n.target, SegmentCall) else params_read(gm, n).values()
        for p in params:
            if p.requires_grad and storage_key(p) not in seen:
                seen.add(storage_key(p))
                completed[n] = completed.get(n, 0) + p.numel() * p.element_size()
    return completed


def _forward_seconds(node: torch.fx.Node, gm: torch.fx.GraphModule, device: str) -> float:
    """Estimated seconds of node's forward; a segment's, the nodes of its module."""
    if isinstance(node.target, SegmentCall):
        module = node.target.module
        return sum(forward_costs(module, [n for n in module.graph.nodes if n.op.startswith("call")], device)) / 1e9
    return forward_costs(gm, [node], device)[0] / 1e9
