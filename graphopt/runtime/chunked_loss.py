"""A linear head and the fused cross-entropy after it as one op, run over chunks of rows: the
logits of the whole batch are never made, unless the graph uses them elsewhere, and their
gradient never is (Liger-Kernel's fused linear cross-entropy, here for whatever row group the
fuse pass formed after the head: a scale, a bias, the loss).

1. Forward, per chunk of rows (tokens): the chunk's logits, linear(h_c, W, b); the row group's
   per-row losses (its FusedRowOp: kernels, or FakeTensors' allocations). Where a gradient is
   wanted, the row group's backward gives the logits' gradient for a loss gradient of one, and
   the chunk's share of the gradients of h, W, b and the group's other inputs is formed at once
   (two matmuls), so the chunk's logits and their gradient are freed before the next chunk.
   The loss is the rows' sum, or their mean over the rows not ignored, as F.cross_entropy's.
2. Backward: those gradients times the loss's incoming gradient, scaled in place and handed on
   (the weight's gradient is not copied); so the op is backpropagated through once, and a
   second backward is an error. Where the graph uses the logits too (a model that returns
   them) and they get a gradient, linear's backward of it is added; only then are h and the
   weight kept.

The matmuls a step runs are eager's (the head's forward, and two for its backward), moved into
the forward; the weight's gradient is summed over the chunks, which rounds differently from
eager's one matmul by the order of the additions.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..codegen.row_group import ROW
from .fused_row import FusedRowOp


def chunk_rows(rows: int, classes: int, hidden: int) -> int:
    """Liger's chunk: a power of two of rows whose logits are about as large as the head's input."""
    per = max(math.ceil(classes / max(hidden, 1)), 1)
    return min(1 << max(math.ceil(rows / per) - 1, 0).bit_length(), max(rows, 1))


class ChunkedHeadLoss:
    """rows: the FusedRowOp of the loss (one output, a cross-entropy's mean or sum); logits_at:
    the place of the logits among its given inputs; chunk: rows per chunk (chunk_rows by
    default); returns_logits: the call also returns the logits, linear(h, W, b) at h's shape.
    Called as (h, weight, bias or None, *the row op's other given inputs)."""

    def __init__(self, rows: FusedRowOp, logits_at: int, chunk: int | None = None, returns_logits: bool = False):
        self.rows, self.logits_at, self.chunk, self.returns_logits = rows, logits_at, chunk, returns_logits
        (self.finish,) = rows.finish
        self.per_row = FusedRowOp(rows.group, (None,), rows.orders, rows.col_dims)  # the rows' losses, unreduced
        self.__name__ = self.__qualname__ = "chunked_linear_" + rows.__name__

    def __repr__(self) -> str:
        return f"ChunkedHeadLoss({self.rows.group.describe()}, chunk={self.chunk})"

    def sized(self, chunk: int | None) -> "ChunkedHeadLoss":
        """The same op with `chunk` rows per chunk (None: chunk_rows); a new object, so a graph
        holding it is a new version of the graph (analysis/cache.py)."""
        return ChunkedHeadLoss(self.rows, self.logits_at, chunk, self.returns_logits)

    def __call__(self, h, weight, bias, *others):
        tensors = [t for t in (h, weight, bias, *others) if t is not None]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            out = _HeadLossFunction.apply(self, h, weight, bias, *others)
        else:
            out = self.run(h, weight, bias, others, ())[:2]
        return out if self.returns_logits else out[0]

    def _given(self, logits, others) -> list:
        given = list(others)
        given.insert(self.logits_at, logits)
        return given

    def run(self, h, weight, bias, others, needs) -> tuple:
        """(loss, logits or None, the gradients of (h, weight, bias, *others) for a loss gradient
        of one where needs says so)."""
        rows, classes = math.prod(h.shape[:-1]), weight.shape[0]
        flat = h.reshape(rows, h.shape[-1])
        logits = F.linear(h, weight, bias) if self.returns_logits else None
        flat_logits = None if logits is None else logits.reshape(rows, classes)
        per_row = [self._kind(i + (i >= self.logits_at)) == ROW and t.dim() > 0 for i, t in enumerate(others)]
        shaped = [t.reshape(rows, 1) if r else t for t, r in zip(others, per_row)]
        scale = self._scale(others, h)
        grads = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) if n else None  # contiguous: filled by rows
                 for t, n in zip((h, weight, bias, *others), needs or ())]
        total = None
        step = self.chunk or chunk_rows(rows, classes, h.shape[-1])
        for start in range(0, rows, step):
            part = slice(start, min(start + step, rows))
            h_c = flat[part]
            z = flat_logits[part] if flat_logits is not None else F.linear(h_c, weight, bias)
            given = self._given(z, [t[part] if r else t for t, r in zip(shaped, per_row)])
            losses = self.per_row.forward(given)[0]
            total = losses.sum() if total is None else total + losses.sum()
            if any(needs):
                self._chunk_grads(grads, part, h_c, weight, given, scale.expand(losses.shape), needs)
        if total is None:
            total = h.new_zeros(())
        loss = total * scale if self.finish[0] == "mean" else total
        return loss, logits, grads

    def _scale(self, others, like) -> torch.Tensor:
        """A row's share of the loss: 1 / the rows not ignored for the mean, 1 for the sum."""
        reduction, k, ignore = self.finish
        if reduction != "mean":
            return like.new_ones(())
        target = others[self.rows.given.index(k) - (self.rows.given.index(k) > self.logits_at)]
        return 1.0 / (target != ignore).sum().to(like.dtype)

    def _chunk_grads(self, grads, part, h_c, weight, given, row_grads, needs) -> None:
        """Add the chunk's gradients for a loss gradient of one into grads: h's and a per-row
        input's at the chunk's rows, the weight's, the bias's and a per-column input's summed."""
        others = [k for k in range(len(given)) if k != self.logits_at]
        wants = [True] * len(given)  # the logits'; then each other input's where it wants one
        for i, k in enumerate(others):
            wants[k] = bool(needs[3 + i])
        d = self.per_row.backward(given, [row_grads], wants)
        dz = d[self.logits_at]
        if needs[0]:
            grads[0].view(-1, h_c.shape[-1])[part].addmm_(dz, weight)
        if needs[1]:
            grads[1].addmm_(dz.t(), h_c)  # into the sum: no weight-sized product per chunk
        if needs[2]:
            grads[2] += dz.sum(0)
        for i, k in enumerate(others):
            g, into = d[k], grads[3 + i]
            if g is None or into is None:
                continue
            if self._kind(k) == ROW and into.dim():
                into.view(-1, 1)[part] += g.reshape(-1, 1)
            else:
                into += g

    def _kind(self, k: int) -> str:
        """The class of the row op's given input k."""
        return self.rows.group.input_kind(self.rows.given[k])


class _HeadLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op: ChunkedHeadLoss, h, weight, bias, *others):
        ctx.set_materialize_grads(False)
        needs = ctx.needs_input_grad[1:]
        with torch.no_grad():
            loss, logits, grads = op.run(h, weight, bias, others, needs)
        ctx.save_for_backward(*[g for g in grads if g is not None],
                              *((h, weight) if op.returns_logits and any(needs[:3]) else ()))
        ctx.have, ctx.spent = [g is not None for g in grads], False
        return (loss, logits) if op.returns_logits else (loss, )

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_logits=None):
        if ctx.spent:
            raise RuntimeError("graphopt: a chunked linear head and its loss (fuse) are backpropagated through once; "
                               "for a second backward (retain_graph=True), optimize with passes that leave out fuse")
        ctx.spent = True
        saved = list(ctx.saved_tensors)
        pre = [saved.pop(0) if have else None for have in ctx.have]
        # scaled where they are: the gradients are the caller's now (no second copy of the weight's)
        grads = [None if p is None or grad_loss is None else p.mul_(grad_loss) for p in pre]
        if grad_logits is not None and saved:
            h, weight = saved
            g = grad_logits.reshape(-1, weight.shape[0])
            flat = h.reshape(-1, h.shape[-1])
            extra = (g @ weight).reshape(h.shape), g.t() @ flat, g.sum(0)
            for i, e in enumerate(extra):
                if ctx.needs_input_grad[1 + i]:
                    grads[i] = e if grads[i] is None else grads[i].add_(e)
        return (None, *grads)
