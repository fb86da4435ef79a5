"""Running a fused row group (codegen/row_group.py): a norm, softmax or reduction over the last dim
with the elementwise ops around it, as one autograd op.

1. FusedRowOp(group)(*inputs) applies an autograd.Function whose forward runs the group and saves
   only what its backward kernel reads: the inputs a derivative needs (not an add's operands),
   or, where that keeps fewer full-size tensors, an output in their place (a residual add before
   a norm keeps the sum, as the norm's eager backward does, not both addends). Eager's norm saves
   its input and per-row statistics, its softmax its output, the elementwise ops around them
   what they read. The backward kernel recomputes the row from what was kept, and also forms the
   column reductions a weight's gradient needs.
2. Where it runs, as fused.py's groups: CUDA tensors and, under TRITON_INTERPRET=1, CPU tensors run
   the row kernels (row_kernel.py); other CPU tensors run the group's steps as torch ops on the
   rows (row_reference), the backward recomputing them under autograd. FakeTensors allocate what a
   run allocates and launch nothing.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..codegen.group import Step
from ..codegen.program import forward_expr, name
from ..codegen.row_group import COL, FULL, ROW, RowGroup, Softmax
from ..codegen.row_kernel import row_backward, row_forward
from ..codegen.row_program import backward_reads
from ..codegen.row_space import RowSpace, empty_like_order
from ..ops.shim import tl
from .dropout_masks import holes, inserted, with_masks
from .fused import MAX_PLANS, STATS, _device, _inside, _runs_kernel, _shape_only, release_interpreted_arguments


def row_reference(group: RowGroup, inputs, space: RowSpace) -> list[torch.Tensor]:
    """The group's outputs computed by torch ops, each value broadcast over the rows as eager
    would, a half step rounded as the kernels round it; differentiable, so autograd gives the
    reference gradients."""
    scope = {"tl": tl, "round_bf16": lambda t: _rounded(t, torch.bfloat16), "round_fp16": lambda t: _rounded(t, torch.float16)}
    for k, t in enumerate(inputs):
        if t is None:  # the column index
            t = torch.arange(space.columns, dtype=torch.float32, device=next(x for x in inputs if x is not None).device)
        elif group.input_kind(k) == ROW and t.dim() < len(space.shape):
            t = t.reshape(space.row_shape())
        elif group.inputs[k].shift:
            t = _shifted(t, group.inputs[k].shift)
        scope[f"x{k}"] = t.to(torch.float32)
    for j, step in enumerate(group.steps):
        dtype = group.dtypes[j]
        if isinstance(step, Step):
            value = eval(forward_expr(step, dtype), scope)
        elif isinstance(step, Softmax):  # its max a shift, as in eager's softmax: no gradient through it
            arg = scope[name(step.arg)]
            shifted = arg - arg.detach().amax(space.col_dims, keepdim=True)
            total = shifted.exp().sum(space.col_dims, keepdim=True)
            value = _rounded(shifted - total.log() if step.log else shifted.exp() / total, dtype)
        else:
            arg = scope[name(step.arg)]
            value = _rounded(arg.sum(space.col_dims, keepdim=True) if step.kind == "sum"
                             else arg.amax(space.col_dims, keepdim=True), dtype)
        scope[f"v{j}"] = torch.as_tensor(value)
    return [scope[f"v{j}"].broadcast_to(space.shape if group.step_kind(j) == FULL else space.row_shape())
            for j in group.outputs]


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if dtype == torch.float32 else t.to(dtype).to(torch.float32)


def _shifted(t: torch.Tensor, shift: int) -> torch.Tensor:
    """Column j holds t's column j + shift, 0 past either end."""
    c = t.shape[-1]
    pad = torch.zeros(t.shape[:-1] + (min(abs(shift), c),), dtype=t.dtype, device=t.device)
    return torch.cat([t[..., shift:], pad], -1) if shift > 0 else torch.cat([pad, t[..., :c + shift]], -1)


class _RowFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, *inputs):
        ctx.set_materialize_grads(False)  # a missing output gradient stays None: the kernel skips it
        ctx.op = op
        given = inputs[:len(op.given)]  # not the state the call just updated
        keep, loaded = op.kept_for_backward(given, ctx.needs_input_grad[1:len(op.given) + 1])
        outputs = op.forward(inputs, loaded)
        stored = dict(zip([j for j in loaded if j not in op.group.outputs], outputs[op.returned:]))
        outputs = outputs[:op.returned]
        ctx.save_for_backward(*[t if k in keep else None for k, t in enumerate(given)],
                              *[stored[j] if j in stored else outputs[op.group.outputs.index(j)] for j in loaded])
        ctx.loaded, ctx.shapes, ctx.space = loaded, [tuple(t.shape) for t in given], op.space(op._all(given))
        ctx.state = len(inputs) - len(op.given)
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs, loaded = saved[:len(ctx.shapes)], dict(zip(ctx.loaded, saved[len(ctx.shapes):]))
        needs = ctx.needs_input_grad[1:len(ctx.op.given) + 1]
        return (None, *ctx.op.backward(inputs, grads, needs, loaded, ctx.shapes, ctx.space), *[None] * ctx.state)


class FusedRowOp:
    """A fused row group as a callable: one tensor for a one-output group, else a tuple in
    group.outputs order. It has a __name__, so an FX call_function node can target it.

    It takes the group's inputs but its column index (the kernel makes that one), then the state
    it updates. Its rows lie along col_dims (the last dim; a batch norm's: every dim but the
    channels'). finish, per output, turns its rows into the node's value: None (as they are), or
    a cross entropy's reduction of its rows' losses, ("mean" | "sum" | "none", the class indices'
    input, ignore_index). updates, per batch norm in training: (the batch mean's and variance's
    outputs, which the call keeps to itself; the running mean, running variance and batch count
    (or None) as places in the state; momentum), applied as eager's batch norm applies them."""

    def __init__(self, group: RowGroup, finish: tuple = (), orders: tuple = (), col_dims: tuple | None = None,
                 updates: tuple = (), draws: tuple = ()):
        self.group, self.updates = group, tuple(updates)
        self.draws = tuple(draws)  # (input place, keep, dtype, sourced) of each mask the call draws (dropout_masks.py)
        self.returned = len(group.outputs) - 2 * len(self.updates)
        self.finish = tuple(finish) or (None,) * self.returned
        self.orders, self.col_dims = tuple(orders), col_dims
        self.given = [k for k in range(len(group.inputs)) if not group.is_index(k)]
        self.loaded = self._choose_loaded()
        self._extended: dict[tuple, RowGroup] = {}
        self._spaces: dict[tuple, RowSpace] = {}  # input shapes -> the call's rows (space())
        self.__name__ = self.__qualname__ = "fused_row_" + group.describe().replace(" -> ", "_")[:80]

    def __getstate__(self):
        return {"group": self.group, "finish": self.finish, "orders": self.orders, "col_dims": self.col_dims,
                "updates": self.updates, "draws": self.draws}

    def __setstate__(self, state):
        self.__init__(**state)

    def space(self, inputs) -> RowSpace:
        """The rows of this call: the shape every input broadcasts to (a vector per row or per
        column given in another rank aside), with the rows' col dims (the last by default).
        Worked out once per set of input shapes: calls repeat them."""
        key = tuple(None if t is None else tuple(t.shape) for t in inputs)
        found = self._spaces.get(key)
        if found is None:
            if len(self._spaces) >= MAX_PLANS:
                self._spaces.clear()
            found = self._spaces[key] = self._space(inputs)
        return found

    def _space(self, inputs) -> RowSpace:
        rank = max(t.dim() for k, t in enumerate(inputs) if t is not None and self.group.input_kind(k) == FULL)
        shapes = [t.shape for k, t in enumerate(inputs)
                  if t is not None and not (self.group.input_kind(k) in (ROW, COL) and t.dim() != rank)]
        shape = tuple(torch.broadcast_shapes(*shapes))
        return RowSpace(shape, self.col_dims) if self.col_dims is not None else RowSpace.last(shape)

    def __repr__(self) -> str:
        return f"FusedRowOp({self.group.describe()})"

    def __call__(self, *inputs):
        taken = len(self.given) - inserted(self.draws) + self._state_count()
        if len(inputs) != taken:
            raise TypeError(f"{self.__name__} takes {taken} tensors, got {len(inputs)}")
        if self.draws:  # a dropout's mask has the rows' shape
            given = inputs[:len(self.given) - inserted(self.draws)]
            space = self.space(self._all(holes(given, self.draws)))
            inputs = with_masks(given, self.draws, space.shape, _device(given)) + inputs[len(given):]
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            outputs = _RowFunction.apply(self, *inputs)
        else:
            outputs = tuple(self.forward(inputs))
        return outputs[0] if len(outputs) == 1 else outputs

    def _state_count(self) -> int:
        return max((max(k for k in u[2:5] if k is not None) + 1 for u in self.updates), default=0)

    def _all(self, inputs) -> list:
        """The group's inputs: the given ones, None for the column index."""
        full = [None] * len(self.group.inputs)
        for k, t in zip(self.given, inputs):
            full[k] = t
        return full

    def forward(self, inputs, kept: tuple = ()) -> list[torch.Tensor]:
        """The outputs the graph takes; then, for each step in kept that is no output, its value
        (the kernel stores it for the backward)."""
        inputs, state = inputs[:len(self.given)], inputs[len(self.given):]
        fake, device = _shape_only(inputs), _device(inputs)
        everything = self._all(inputs)
        space = self.space(everything)
        extra = tuple(j for j in kept if j not in self.group.outputs)
        group = self._storing(extra) if extra else self.group
        if not fake:
            self.check_classes(everything)
        with _inside():
            STATS["launches"] += not fake
            if fake or _runs_kernel(device):
                rows = row_forward(group, everything, launch=not fake, space=space, orders=self.orders)
                release_interpreted_arguments()
            else:
                with torch.no_grad():
                    values = row_reference(self.group, everything, space)
                rows = [empty_like_order(v.shape, self.orders[i] if i < len(self.orders) else None, group.dtypes[j],
                                         device).copy_(v) for i, (v, j) in enumerate(zip(values, self.group.outputs))]
            if not fake:
                self._update(rows, state, space)
            finished = [self._finished(o, f, everything) for o, f in zip(rows[:self.returned], self.finish)]
            return finished + rows[len(self.group.outputs):]

    def _storing(self, extra: tuple) -> RowGroup:
        """The group with the steps the backward reads as outputs too: one object per choice, whose programs
        and kernel are then built once (codegen remembers them per group)."""
        if extra not in self._extended:
            g = self.group
            self._extended[extra] = RowGroup(g.inputs, g.steps, g.outputs + extra, g.origin, g.dtypes, g.fp32_terms)
        return self._extended[extra]

    def _update(self, rows, state, space: RowSpace) -> None:
        """A batch norm's running statistics, as eager's batch norm updates them (the variance
        unbiased), and its batch count."""
        n = space.columns
        with torch.no_grad():
            for mean_out, var_out, mean_at, var_at, count_at, momentum in self.updates:
                mean, var = state[mean_at], state[var_at]
                batch_mean = rows[mean_out].reshape(mean.shape)
                batch_var = rows[var_out].reshape(var.shape) * (n / max(n - 1, 1))
                mean.copy_(momentum * batch_mean + (1 - momentum) * mean)
                var.copy_(momentum * batch_var + (1 - momentum) * var)
                if count_at is not None:
                    state[count_at].add_(1)

    def kept_for_backward(self, inputs, needs) -> tuple[set[int], tuple]:
        """(the given inputs the backward reads, the steps whose outputs it reads instead of
        recomputing them), for the given inputs that need a gradient: with the kernels, what
        backward_reads says for self.loaded; the torch path recomputes everything from every input."""
        device = _device(inputs)
        if not (_shape_only(inputs) or _runs_kernel(device)):
            return set(range(len(inputs))), ()
        has = [True] * self.returned + [False] * (len(self.group.outputs) - self.returned)
        read, loaded = backward_reads(self.group, has, [bool(n) for n in self._all(needs)], self.loaded)
        return {i for i, k in enumerate(self.given) if k in read}, tuple(sorted(loaded))

    def _choose_loaded(self) -> frozenset:
        """The FULL steps the backward reads, stored by the forward, instead of recomputing them,
        where that keeps fewer full-size tensors for it: a residual add before a norm keeps the
        sum, which the norm's eager backward keeps too, rather than both addends. Tried: none, each
        FULL step alone, every FULL output; the fewest kept wins, ties to the fewest stored, then
        to reading outputs rather than inputs: an output is what eager's softmax keeps, and a
        consumer that saves it (attention's next matmul) shares it, where an input would be
        kept for this call alone."""
        group = self.group
        has = [True] * self.returned + [False] * (len(group.outputs) - self.returned)
        needs = [not group.is_index(k) for k in range(len(group.inputs))]
        full = [j for j in range(len(group.steps)) if group.step_kind(j) == FULL]
        outputs = frozenset(j for j in group.outputs[:self.returned] if group.step_kind(j) == FULL)

        def kept(loaded) -> tuple[int, int, int]:
            read, steps = backward_reads(group, has, needs, loaded)
            return (sum(group.input_kind(k) == FULL for k in read) + len(steps), len(loaded - set(group.outputs)),
                    -len(steps & outputs))
        return min([frozenset(), outputs, *(frozenset({j}) for j in full)], key=kept)

    def backward(self, inputs, grads, needs, loaded: dict, shapes: list, space: RowSpace) -> list[torch.Tensor | None]:
        """The gradients of the given inputs (the state gets none); inputs the backward does not
        read are None, loaded holds the outputs it reads instead of recomputing them."""
        grads = list(grads[:self.returned]) + [None] * (len(self.group.outputs) - self.returned)
        if all(g is None for g in grads):
            return [None] * len(inputs)
        present = [t for t in [*inputs, *loaded.values()] if t is not None]
        given = [g for g in grads if g is not None]
        # a group of adds reads nothing back: the gradients tell the device
        fake, device = _shape_only(present + given), _device(present or given)
        everything = self._all(inputs)
        grads = [None if g is None else self._rows_of(g, f, everything)
                 for g, f in zip(grads, self.finish + (None,) * (len(grads) - len(self.finish)))]
        wants, all_shapes = self._all(needs), self._all(shapes)
        with _inside():
            STATS["launches"] += not fake
            if fake or _runs_kernel(device):
                result = row_backward(self.group, everything, grads, [bool(w) for w in wants], launch=not fake,
                                      space=space, loaded=loaded, shapes=all_shapes)
                release_interpreted_arguments()
            else:
                result = self._reference_backward(everything, grads, [bool(w) for w in wants])
        return [result[k] for k in self.given]

    def _reference_backward(self, inputs, grads, needs):
        wanted = [None if t is None else t.detach().requires_grad_(need) for t, need in zip(inputs, needs)]
        with torch.enable_grad():
            outs = row_reference(self.group, wanted, self.space(inputs))
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        found = iter(torch.autograd.grad([o for o, _ in pairs], [t for t, n in zip(wanted, needs) if n],
                                         [g for _, g in pairs], allow_unused=True))
        result = []
        for t, need in zip(inputs, needs):
            g = next(found) if need else None
            result.append(torch.zeros_like(t) if need and g is None else g)
        return result

    # a cross entropy's rows of losses and the node's value

    def _finished(self, rows: torch.Tensor, finish, inputs) -> torch.Tensor:
        if finish is None:
            return rows
        reduction, k, ignore = finish
        if reduction == "none":
            return rows.reshape(rows.shape[:-1])
        total = rows.sum()
        return total / (inputs[k] != ignore).sum() if reduction == "mean" else total

    def _rows_of(self, grad: torch.Tensor, finish, inputs) -> torch.Tensor:
        """The gradient of an output's rows, from the gradient of the node's value."""
        if finish is None:
            return grad
        reduction, k, ignore = finish
        rows = inputs[k].shape + (1,)
        if reduction == "none":
            return grad.reshape(rows)
        scale = grad / (inputs[k] != ignore).sum() if reduction == "mean" else grad
        return scale.expand(rows)

    def check_classes(self, inputs, classes: int | None = None) -> None:
        """A class index out of range is an error in eager; the kernel would pick no logit. inputs:
        the group's (None for the column index); classes: the logits' columns, where inputs has
        no logits (a chunked head makes them)."""
        if any(isinstance(t, torch.Tensor) and _shape_only([t]) for t in inputs):
            return
        for finish in self.finish:
            if finish is None:
                continue
            _, k, ignore = finish
            target = inputs[k]
            if classes is None:
                classes = next(t for j, t in enumerate(inputs) if t is not None and self.group.input_kind(j) == FULL).shape[-1]
            bad = ((target < 0) | (target >= classes)) & (target != ignore)
            if bool(bad.any()):
                raise IndexError(f"Target {int(target[bad][0])} is out of bounds: cross_entropy over {classes} "
                                 "classes takes class indices in [0, classes) or ignore_index")
