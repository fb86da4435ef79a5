"""Copies between a CUDA device and pinned host memory on streams of their own, so that they run
beside the step's kernels rather than between them: one stream down (device to host) and one up per
device, as torchtune's activation offloading and FSDP2's CPUOffloadPolicy keep theirs, and as the
documents this library follows advise for host-device copies.

Three orderings make it safe, and each is the caching allocators' own rule:
- a copy waits for what the step's stream has queued so far (the tensor it reads is written there;
  the block it writes may have been the step's a moment ago);
- a device tensor a copy down reads is recorded on the down stream (record_stream), so the
  allocator gives its block to no one before the copy is done, however soon the step lets it go;
- the step's stream waits for a copy up's event before anything reads what it brought.
The pinned host buffers need nothing: the host allocator records each copy's stream itself.

Used by runtime/offload.py (a segment's inputs down in the forward, up before its backward) and
runtime/host_optimizer.py (each gradient down as backward makes it). Streams are made at their first
use on a device and kept: a copy costs its queueing, not a stream's creation.
"""
from __future__ import annotations

import torch

from ..analysis.host_tier import on_host

_streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}


def _pair(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(down, up) streams of `device`, made at first use."""
    found = _streams.get(device)
    if found is None:
        found = _streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return found


def down(t: torch.Tensor, into: torch.Tensor | None = None,
         marked: bool = True) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """t (on a CUDA device) copied into pinned host memory (into, or a new buffer of t's strides) on
    the down stream, after what the step has queued: (the host tensor, the copy's event; None
    unless marked, for a caller that waits with settle())."""
    stream = _pair(t.device)[0]
    if into is None:
        with on_host():
            into = torch.empty_like(t, device="cpu", pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        into.copy_(t, non_blocking=True)
    t.record_stream(stream)
    return into, stream.record_event() if marked else None


def up(host: torch.Tensor, device: torch.device,
       after: torch.cuda.Event | None) -> tuple[torch.Tensor, torch.cuda.Event]:
    """host (pinned) copied to `device` on the up stream, after what the step has queued and after the
    event `after` (its copy down): (the device tensor, the copy's event, for ready())."""
    current, stream = torch.cuda.current_stream(device), _pair(device)[1]
    brought = torch.empty_like(host, device=device)  # the step's block: freed where the step reads it
    stream.wait_stream(current)
    if after is not None:
        stream.wait_event(after)
    with torch.cuda.stream(stream):
        brought.copy_(host, non_blocking=True)
    return brought, stream.record_event()


def ready(event: torch.cuda.Event, device: torch.device) -> None:
    """The step's stream on `device` waits for `event` (a copy up) before what it queues next."""
    torch.cuda.current_stream(device).wait_event(event)


def settle(device: torch.device) -> None:
    """The host waits for every copy down on `device` (before it reads what they brought)."""
    if device in _streams:
        _streams[device][0].synchronize()
