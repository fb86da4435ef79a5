"""What a rewritten graph calls to recompute a segment during backward, and batch norm that a
rerun leaves alone.

RecomputeSegment runs its GraphModule through torch.utils.checkpoint (non-reentrant), so the
forward keeps only the segment's inputs and the backward runs it again, with the RNG state of
the first run where the segment draws (dropout draws the same mask). A segment that draws
nothing skips saving and restoring the RNG state, and checkpoint calls its forward directly: the
rerun stops early with an exception, and GraphModule's call wrapper would format a traceback for
each one, a large share of what a small segment costs on the host.

BatchNorm in training becomes batch_norm_once in a segment: its rerun (flagged by checkpoint's
context_fn) normalizes with the same batch statistics and updates copies of the running
statistics, not the real ones, so they are updated once per step, as without recompute.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..analysis.segments import SegmentCall, keeps_output, recomputing, rerun


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if keeps_output(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts():
    return contextlib.nullcontext(), rerun()


def _selective_contexts():
    forward, recompute = create_selective_checkpoint_contexts(_policy)
    return forward, _both(recompute, rerun())


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


class RecomputeSegment(SegmentCall):
    """The callable a rewritten graph calls for segment k. A selective segment keeps the
    outputs of its matmuls, convolutions and attention and reruns only the rest."""

    def __init__(self, index: int, module: torch.fx.GraphModule, selective: bool = False, draws: bool = True):
        super().__init__(index, module, selective)
        self.draws = draws
        self.__module__ = __name__

    def __call__(self, *args):
        contexts = _selective_contexts if self.selective else _contexts
        return checkpoint(self.module.forward, *args, use_reentrant=False, context_fn=contexts,
                          preserve_rng_state=self.draws)


def batch_norm_once(x, weight, bias, running_mean, running_var, momentum, eps):
    """Training-mode batch norm that updates the running statistics only on its first run.

    Both runs update copies, and the first copies them back: the two runs then call the same
    ops and save the same tensors, which checkpoint (and its selective form) checks."""
    mean, var = _copy(running_mean), _copy(running_var)
    out = F.batch_norm(x, mean, var, weight, bias, True, momentum, eps)
    if not recomputing():
        for real, updated in ((running_mean, mean), (running_var, var)):
            if real is not None:
                real.copy_(updated)
    return out


class BatchNormOnce:
    """batch_norm_once for an nn.BatchNorm module, with its num_batches_tracked and momentum=None
    (a cumulative average) as the module's own forward has them."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.__name__ = self.__qualname__ = "batch_norm_once"
        self.__module__ = __name__

    def __call__(self, x):
        m = self.module
        counted = m.track_running_stats and m.num_batches_tracked is not None
        if counted and not recomputing():
            m.num_batches_tracked.add_(1)
        momentum = m.momentum if m.momentum is not None else (1.0 / float(m.num_batches_tracked) if counted else 0.0)
        return batch_norm_once(x, m.weight, m.bias, m.running_mean if m.track_running_stats else None,
                               m.running_var if m.track_running_stats else None, momentum, m.eps)


def _copy(t):
    return None if t is None else t.clone()
