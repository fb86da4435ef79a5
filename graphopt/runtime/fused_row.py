"""Running a fused row group (codegen/row_group.py): a norm, softmax or reduction over the last dim
with the elementwise ops around it, as one autograd op, everything a call derives bound once per
input signature (as fused.py's groups).

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
3. The first call of an input signature binds a _RowCall: the rows, what the backward keeps, the
   codegen's RowForward (outputs' layouts, the launch's arguments) and its launch (launch.py); a
   _RowBackward per signature of the incoming gradients likewise. Later calls allocate and launch.
4. Class indices (a cross entropy's target) out of range are refused as eager refuses them, with
   no sync: on CUDA the forward kernel asserts on the device (row_kernel.class_checks); on CPU a
   torch check runs (torch._assert_async), whose failure is eager's IndexError.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..codegen.group import Step
from ..codegen.program import forward_expr, name
from ..codegen.row_group import COL, FULL, ROW, RowGroup, Softmax
from ..codegen.row_launch import RowBackward, RowForward
from ..codegen.row_program import backward_reads
from ..codegen.row_space import RowSpace, empty_like_order
from ..ops.shim import tl
from .dropout_masks import holes, inserted, with_masks, with_stand_ins
from .fused import (MAX_PLANS, STATS, _GENERATION, check_kinds, enter, group_device, interpreting, leave, mode_of,
                    signature_key)
from .launch import bind


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
    def forward(ctx, call, *inputs):
        ctx.set_materialize_grads(False)  # a missing output gradient stays None: the kernel skips it
        ctx.call = call
        outputs = call.run(inputs)
        ctx.save_for_backward(*[t if kept else None for t, kept in zip(inputs, call.keep)],
                              *[outputs[i] for i in call.saved_outputs])
        returned = outputs[:call.op.returned]
        if call.non_differentiable:
            ctx.mark_non_differentiable(*[o for o in returned if not o.is_floating_point()])
        return tuple(returned)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():  # create_graph: the gradients are not differentiable again
            return _once_backward(ctx, *grads)
        call = ctx.call
        return (None, *call.backward(ctx.saved_tensors, grads, ctx.needs_input_grad[1:call.count + 1]),
                *call.no_state)


@once_differentiable
def _once_backward(ctx, *grads):
    call = ctx.call
    return (None, *call.backward(ctx.saved_tensors, grads, ctx.needs_input_grad[1:call.count + 1]), *call.no_state)


class _RowCall:
    """One input signature of a FusedRowOp, bound: where it runs, its rows, what its backward
    keeps, the forward launch; its _RowBackwards by gradient signature. A call's tensors sit in
    one pool, (*inputs, *outputs), the launch's pointers at places worked out here."""

    def __init__(self, op: "FusedRowOp", inputs, autograd: bool):
        self.op, self.autograd = op, autograd
        self.count = len(op.given)
        self.state = len(inputs) - self.count
        self.no_state = (None,) * self.state
        given = inputs[:self.count]
        self.device = group_device(given)
        self.cpu, self.interpreted = self.device.type == "cpu", interpreting()
        self.mode = mode_of(given, self.device)
        self.space = op.space(op._all(given))
        self.shapes = [tuple(t.shape) for t in given]
        if autograd:
            keep, self.loaded = op.kept_for_backward(self.mode, [t.requires_grad for t in given])
        else:
            keep, self.loaded = set(range(self.count)), ()
        self.keep = tuple(k in keep for k in range(self.count))
        self.extra = tuple(j for j in self.loaded if j not in op.group.outputs)
        # what run() returns: the outputs the graph takes, then the extra steps stored for the backward
        self.saved_outputs = tuple(op.returned + self.extra.index(j) if j in self.extra else op.group.outputs.index(j)
                                   for j in self.loaded)
        self.group = op._storing(self.extra) if self.extra else op.group
        self.non_differentiable = any(not op.group.dtypes[j].is_floating_point for j in op.group.outputs[:op.returned])
        checked = self.mode == "reference" or (self.mode == "kernel" and self.cpu)  # on CUDA the kernel checks
        self.checks = tuple((op.given.index(k), i.ignore) for k, i in enumerate(op.group.inputs)
                            if i.ignore is not None) if checked else ()
        # a cross entropy's reduction: (output, how, its class indices' place among the inputs, ignore_index)
        self.finishes = tuple((i, f[0], op.given.index(f[1]), f[2]) for i, f in enumerate(op.finish) if f is not None)
        outputs = len(self.group.outputs)
        self.returns = None if outputs == op.returned else [*range(op.returned), *range(len(op.group.outputs), outputs)]
        self.backwards: dict = {}
        self.launch = None
        if self.mode == "reference":
            self.run = self._reference
            return
        forward = RowForward(self.group, op._all(given), space=self.space, orders=op.orders)
        self.layouts = forward.layouts()
        if self.mode == "kernel" and forward.launch is not None:
            rows = forward.launch
            self.launch = bind(rows.kernel(), rows.grid, rows.scalars, dict(rows.constexprs), self.device)
            if forward.reshaped:  # an input whose view is a copy: made at each call
                self.pointers = lambda inputs, outs: forward.pointers(op._all(inputs[:self.count]), outs)
            else:
                places = self._places(forward.places, len(op.group.inputs), len(inputs))
                self.pointers = lambda inputs, outs: _pick((*inputs, *outs), places)
        self.run = self._kernel

    def _places(self, places, group_inputs: int, inputs: int) -> tuple:
        """The forward's places in (*the group's inputs, *outputs) as places in (*inputs, *outputs)."""
        given = self.op.given
        return tuple(given.index(p) if p < group_inputs else inputs + p - group_inputs for p in places)

    def __call__(self, inputs):
        if self.op.draws:  # a dropout's mask has the rows' shape
            given = inputs[:len(self.op.given) - inserted(self.op.draws)]
            inputs = with_masks(given, self.op.draws, self.space.shape, self.device) + inputs[len(given):]
        outputs = _RowFunction.apply(self, *inputs) if self.autograd else self.run(inputs)[:self.op.returned]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _kernel(self, inputs) -> list:
        """The outputs the graph takes; then, for each step kept that is no output, its value (the
        kernel stores it for the backward)."""
        op = self.op
        enter()
        try:
            if self.checks:
                self._check(inputs)
            device = self.device
            rows = [torch.empty_strided(shape, strides, dtype=dtype, device=device)
                    for shape, strides, dtype in self.layouts]
            if self.launch is not None:
                self.launch(*self.pointers(inputs, rows))
            if self.mode != "fake":
                STATS["launches"] += 1
                if op.updates:
                    op.update(rows, inputs[self.count:], self.space)
            for i, how, at, ignore in self.finishes:
                rows[i] = finished(rows[i], how, inputs[at], ignore)
            return rows if self.returns is None else [rows[i] for i in self.returns]
        finally:
            leave()

    def _reference(self, inputs) -> list:
        op = self.op
        enter()
        try:
            self._check(inputs)
            everything = op._all(inputs[:self.count])
            with torch.no_grad():
                values = row_reference(op.group, everything, self.space)
            rows = [empty_like_order(v.shape, op.orders[i] if i < len(op.orders) else None, op.group.dtypes[j],
                                     self.device).copy_(v) for i, (v, j) in enumerate(zip(values, op.group.outputs))]
            STATS["launches"] += 1
            if op.updates:
                op.update(rows, inputs[self.count:], self.space)
            for i, how, at, ignore in self.finishes:
                rows[i] = finished(rows[i], how, inputs[at], ignore)
            return rows[:op.returned]
        finally:
            leave()

    def _check(self, inputs) -> None:
        """Step 4 off CUDA: each class index a column or the ignored value, checked by torch."""
        for at, ignore in self.checks:
            target = inputs[at]
            ok = ((target >= 0) & (target < self.space.columns)) | (target == ignore)
            try:
                torch._assert_async(ok.all(), "class index out of range")
            except RuntimeError:
                raise IndexError(f"Target {int(target[~ok][0])} is out of bounds: cross_entropy over "
                                 f"{self.space.columns} classes takes class indices in [0, classes) or "
                                 "ignore_index") from None

    def backward(self, saved, grads, needs) -> list:
        """The given inputs' gradients (the state gets none). saved: the given inputs (None where
        the backward does not read one), then the steps it reads instead of recomputing them."""
        op = self.op
        if len(grads) != len(op.group.outputs):
            grads = (*grads[:op.returned], *[None] * (len(op.group.outputs) - op.returned))
        if all(g is None for g in grads):
            return [None] * self.count
        key = (needs, *[None if g is None else (g.__class__, g.dtype, g.shape, g.stride()) for g in grads])
        if self.finishes:
            grads = list(grads)
            for i, how, at, ignore in self.finishes:
                if grads[i] is not None:
                    grads[i] = rows_of(grads[i], how, saved[at], ignore)
        call = self.backwards.get(key)
        if call is None:
            if len(self.backwards) >= MAX_PLANS:
                self.backwards.clear()
            call = self.backwards[key] = _RowBackward(self, saved, grads, needs)
        return call.run(saved, grads)


def _pick(pool: tuple, places: tuple) -> list:
    return [pool[i] for i in places]


def finished(rows: torch.Tensor, how: str, target: torch.Tensor, ignore: int) -> torch.Tensor:
    """A cross entropy's value from its rows' losses: reduced as F.cross_entropy reduces them."""
    if how == "none":
        return rows.reshape(rows.shape[:-1])
    total = rows.sum()
    return total / (target != ignore).sum() if how == "mean" else total


def rows_of(grad: torch.Tensor, how: str, target: torch.Tensor, ignore: int) -> torch.Tensor:
    """The gradient of a cross entropy's rows of losses, from the gradient of its value."""
    rows = target.shape + (1,)
    if how == "none":
        return grad.reshape(rows)
    scale = grad / (target != ignore).sum() if how == "mean" else grad
    return scale.expand(rows)


class _RowBackward:
    """One signature of a _RowCall's incoming gradients, bound: the codegen's RowBackward and its
    launch. A call's tensors sit in one pool, (*saved, *the gradients of the group's outputs,
    *buffers)."""

    def __init__(self, call: _RowCall, saved, grads, needs):
        self.call = call
        op = call.op
        inputs, loaded = saved[:call.count], dict(zip(call.loaded, saved[call.count:]))
        everything = op._all(inputs)
        wants = [bool(w) for w in op._all(needs)]
        self.mode = "fake" if call.mode == "meta" else call.mode
        if self.mode == "kernel" and mode_of([g for g in grads if g is not None], call.device) != "kernel":
            self.mode = "fake"
        self.wants, self.launch = wants, None
        self.given = tuple(op.given)
        if self.mode == "reference":
            self.run = self._reference
            return
        backward = self.backward = RowBackward(op.group, everything, grads, wants, space=call.space, loaded=loaded,
                                               shapes=op._all(call.shapes))
        if self.mode == "kernel" and backward.launch is not None:
            launch = backward.launch
            self.launch = bind(launch.kernel(), launch.grid, launch.scalars, dict(launch.constexprs), call.device)
            if backward.reshaped:
                self.pointers = lambda saved, grads, buffers: backward.pointers(
                    op._all(saved[:call.count]), dict(zip(call.loaded, saved[call.count:])), grads, buffers)
            else:
                group_inputs = len(op.group.inputs)
                places = tuple(op.given.index(p) if p < group_inputs else call.count + p - group_inputs
                               for p in backward.places)
                self.pointers = lambda saved, grads, buffers: _pick((*saved, *grads, *buffers), places)
        self.run = self._kernel

    def _kernel(self, saved, grads) -> list:
        enter()
        try:
            device, backward = self.call.device, self.backward
            buffers = backward.allocate(device)
            if self.launch is not None:
                self.launch(*self.pointers(saved, grads, buffers))
            if self.mode != "fake":
                STATS["launches"] += 1
            result = backward.gradients(buffers, device)
            return [result[k] for k in self.given]
        finally:
            leave()

    def _reference(self, saved, grads) -> list:
        call = self.call
        op = call.op
        enter()
        try:
            STATS["launches"] += 1
            everything = op._all(saved[:call.count])
            wanted = [None if t is None else t.detach().requires_grad_(need) for t, need in zip(everything, self.wants)]
            with torch.enable_grad():
                outs = row_reference(op.group, wanted, call.space)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
            found = iter(torch.autograd.grad([o for o, _ in pairs], [t for t, n in zip(wanted, self.wants) if n],
                                             [g for _, g in pairs], allow_unused=True))
            result = []
            for t, need in zip(everything, self.wants):
                g = next(found) if need else None
                result.append(torch.zeros_like(t) if need and g is None else g)
            return [result[k] for k in op.given]
        finally:
            leave()


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
                 updates: tuple = (), draws: tuple = (), kinds: tuple = ()):
        self.group, self.updates = group, tuple(updates)
        self.draws = tuple(draws)  # (input place, keep, dtype, sourced) of each mask the call draws (dropout_masks.py)
        self.kinds = tuple(kinds)  # per input taken, its traced (dtype, device type) or None: fused.check_kinds
        self.returned = len(group.outputs) - 2 * len(self.updates)
        self.finish = tuple(finish) or (None,) * self.returned
        self.orders, self.col_dims = tuple(orders), col_dims
        self.given = [k for k in range(len(group.inputs)) if not group.is_index(k)]
        self.taken = len(self.given) - inserted(self.draws) + self._state_count()
        self.loaded = self._choose_loaded()
        self._extended: dict[tuple, RowGroup] = {}
        self._spaces: dict[tuple, RowSpace] = {}  # input shapes -> the call's rows (space())
        self._memo: dict = {}  # (grad mode, input signature) -> _RowCall
        self._generation = _GENERATION[0]
        self.__name__ = self.__qualname__ = "fused_row_" + group.describe().replace(" -> ", "_")[:80]

    def __getstate__(self):
        return {"group": self.group, "finish": self.finish, "orders": self.orders, "col_dims": self.col_dims,
                "updates": self.updates, "draws": self.draws, "kinds": self.kinds}

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
        if len(inputs) != self.taken:
            raise TypeError(f"{self.__name__} takes {self.taken} tensors, got {len(inputs)}")
        try:
            key = (torch.is_grad_enabled(), signature_key(inputs))
        except AttributeError:
            raise TypeError(f"{self.__name__}: its inputs are tensors, got "
                            f"{', '.join(type(t).__name__ for t in inputs)}") from None
        call = self._memo.get(key)
        if call is None or (call.cpu and call.interpreted != interpreting()) or self._generation != _GENERATION[0]:
            call = self._bind(key, inputs)
        return call(inputs)

    def _bind(self, key, inputs) -> _RowCall:
        check_kinds(self.__name__, self.kinds, inputs)
        if self._generation != _GENERATION[0] or len(self._memo) >= MAX_PLANS:
            self._memo.clear()
            self._generation = _GENERATION[0]
        if self.draws:  # the masks' stand-ins: nothing is drawn to bind
            given = inputs[:len(self.given) - inserted(self.draws)]
            space = self.space(self._all(holes(given, self.draws)))
            inputs = with_stand_ins(given, self.draws, space.shape, group_device(given)) + inputs[len(given):]
        autograd = key[0] and any(t.requires_grad for t in inputs)
        call = self._memo[key] = _RowCall(self, inputs, autograd)
        return call

    def _state_count(self) -> int:
        return max((max(k for k in u[2:5] if k is not None) + 1 for u in self.updates), default=0)

    def _all(self, inputs) -> list:
        """The group's inputs: the given ones, None for the column index."""
        full = [None] * len(self.group.inputs)
        for k, t in zip(self.given, inputs):
            full[k] = t
        return full

    def forward(self, inputs) -> list[torch.Tensor]:
        """The outputs the graph takes, outside autograd (a chunked head's rows)."""
        return self._call(inputs).run(inputs)[:self.returned]

    def backward(self, inputs, grads, needs) -> list[torch.Tensor | None]:
        """The given inputs' gradients for these outputs' gradients, every input read (a chunked head's rows)."""
        return self._call(inputs).backward(tuple(inputs), tuple(grads), tuple(needs))

    def _call(self, inputs) -> _RowCall:
        key = (False, signature_key(inputs))
        call = self._memo.get(key)
        if call is None or (call.cpu and call.interpreted != interpreting()) or self._generation != _GENERATION[0]:
            call = self._bind(key, inputs)
        return call

    def _storing(self, extra: tuple) -> RowGroup:
        """The group with the steps the backward reads as outputs too: one object per choice, whose programs
        and kernel are then built once (codegen remembers them per group)."""
        if extra not in self._extended:
            g = self.group
            self._extended[extra] = RowGroup(g.inputs, g.steps, g.outputs + extra, g.origin, g.dtypes, g.fp32_terms)
        return self._extended[extra]

    def update(self, rows, state, space: RowSpace) -> None:
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

    def kept_for_backward(self, mode: str, needs) -> tuple[set[int], tuple]:
        """(the given inputs the backward reads, the steps whose outputs it reads instead of
        recomputing them), for the given inputs that need a gradient: with the kernels (or on
        tensors without data), what backward_reads says for self.loaded; the torch path recomputes
        everything from every input."""
        if mode == "reference":
            return set(range(len(needs))), ()
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
