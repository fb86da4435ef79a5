"""torch.export with dynamic sizes, so that an exported graph runs at other batch sizes and
sequence lengths.

Dim 0 of each tensor input with the batch's rows (batch.batch_rows), and every other dimension
of those of SEQUENCE_DIMS or fewer (a sequence's length), is given to export as Dim.AUTO:
export keeps a size dynamic where the model lets it, over the range it proves (from 2: it
reasons about sizes 0 and 1 apart), and static where the model's code depends on its value (a
projection's width, a position table's length, `if T == 512`). Dim 0 of them all is one
dimension, "batch"; each other dynamic size is named by the first input and dimension it
appears at ("dim 1 of input_ids"), the one name for every place export proved it equal to.
The sizes and their ranges are what the result accepts (runtime/guards.install_sizes_guard).
Not Dim("batch", min=1): measured on torch 2.13, export then traces `if x.shape[0] == 1:` as
false with no guard, and the graph is silently wrong at batch 1. An example batch of one row
keeps its batch static (sizes 0 and 1 are taken as constants), its lengths dynamic. Where
export fails with sizes dynamic, for any reason, fewer are tried: the batch alone, the lengths
alone, then none, and the reason says which went static and why.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.export import Dim

from ..analysis.position_limits import PositionLimit, position_limits
from ..errors import SizeError
from .batch import batch_rows
from .call_signature import signature
from .graph_inputs import program_inputs


@dataclass(frozen=True)
class SizeRange:
    """The sizes export proved one dimension for (inclusive; None: no upper bound); `limit`, where
    the model's own code bounds it lower (analysis/position_limits.PositionLimit)."""

    low: int
    high: int | None
    limit: PositionLimit | None = None

    def __contains__(self, size: int) -> bool:
        return self.low <= size and (self.high is None or size <= self.high)

    def __str__(self) -> str:
        text = f"{self.low} to {self.high}" if self.high is not None else f"{self.low} and up"
        return f"{text} ({self.limit})" if self.limit is not None else text

    def within(self, limit: PositionLimit) -> SizeRange:
        if self.high is not None and self.high <= limit.longest:
            return self
        return SizeRange(self.low, limit.longest, limit)

    def both(self, other: SizeRange) -> SizeRange:
        """The sizes both take."""
        if other.high is None or (self.high is not None and self.high <= other.high):
            return SizeRange(max(self.low, other.low), self.high, self.limit)
        return SizeRange(max(self.low, other.low), other.high, other.limit)


@dataclass(frozen=True)
class BatchRange(SizeRange):
    """The batch sizes an exported graph was proven for."""

    def __str__(self) -> str:
        return f"batch {super().__str__()}"


BATCH = "batch"
# Inputs of up to 3 dimensions are sequences (token ids, masks, embeddings, audio, spectrograms),
# whose lengths vary from batch to batch. An image's height and width stay static: image models
# train at a fixed crop, and export reasons about convolutions' size arithmetic for minutes where
# padding is computed from the size, seconds with the size static.
SEQUENCE_DIMS = 3


@dataclass(frozen=True)
class DynamicSizes:
    """Which sizes of a call an exported graph takes other values of: per leaf of (args, kwargs)
    flattened, per dimension, the name of its dynamic size or None where it is the example's
    (None for a leaf that is no tensor); and the range of each name."""

    names: tuple[tuple[str | None, ...] | None, ...]
    ranges: tuple[tuple[str, SizeRange], ...]

    @property
    def batch(self) -> BatchRange | None:
        found = dict(self.ranges).get(BATCH)
        return None if found is None else BatchRange(found.low, found.high)

    def __str__(self) -> str:
        return "; ".join(f"{BATCH} {r}" if name == BATCH else f"{name}: {r}" for name, r in self.ranges)

    def why_not(self, example: list, call: list) -> str | None:
        """Why a call's leaves (flattened as the example's, whose leaves are `example`) are not
        sizes this graph takes; None when they are. Dtypes, devices and values are the call
        guard's to compare; here the tensors' sizes only."""
        bound: dict[str, int] = {}
        for names, was, got in zip(self.names, example, call):
            if names is None or not isinstance(got, torch.Tensor):
                continue
            if got.dim() != len(names):
                return f"{got.dim()} dimensions where the example has {len(names)}"
            for dim, (name, size, now) in enumerate(zip(names, was.shape, got.shape)):
                if name is None:
                    if size != now:
                        return f"size {now} at dim {dim} of an input the graph takes at size {size} only"
                    continue
                if bound.setdefault(name, now) != now:
                    return f"{name} is {bound[name]} in one input and {now} in another"
        ranges = dict(self.ranges)
        outside = [f"{name} is {size} (it takes {ranges[name]})" for name, size in bound.items()
                   if size not in ranges[name]]
        return ", ".join(outside) if outside else None

    def past_model(self, call: list) -> str | None:
        """Where a call's size is past what the model's own code takes (a position table's rows),
        what and why; None otherwise. No graph takes such a call, eager neither."""
        for names, got in zip(self.names, call):
            if names is None or not isinstance(got, torch.Tensor) or got.dim() != len(names):
                continue
            for name, now in zip(names, got.shape):
                limit = dict(self.ranges)[name].limit if name is not None else None
                if limit is not None and now > limit.longest:
                    return past_limit(name, now, limit)
        return None


def past_limit(name: str, size: int, limit: PositionLimit) -> str:
    """What a size past a position table's rows is refused with: the limit, its reason, the fix."""
    return (f"{name} is {size}, past the model's own limit of {limit.longest}: {limit}, and eager raises "
            f"IndexError past it. Give sequences of at most {limit.longest} (truncate or split them), or a model "
            "with more positions")


def _dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict, batch: bool, lengths: bool) -> dict | None:
    """export's dynamic_shapes, by forward()'s parameter names: Dim.AUTO on dim 0 of each batched
    tensor (with batch) and, with lengths, on the other dims of one of SEQUENCE_DIMS or fewer;
    other inputs static."""
    rows = batch_rows(args, kwargs)
    if rows is None:
        return None
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None

    def spec(value):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            sequence = lengths and value.dim() <= SEQUENCE_DIMS
            picked = [d for d in range(value.dim()) if (batch if d == 0 else sequence)]
            return {d: Dim.AUTO for d in picked} or None
        return None

    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def export(model: torch.nn.Module, args: tuple, kwargs: dict):
    """(ExportedProgram, DynamicSizes or None, why the batch is static: "" when it is not).

    Tried in turn, each where the one before failed: the batch and the lengths, the batch alone,
    the lengths alone, then no size dynamic; the reason names each try that failed and why."""
    rows = batch_rows(args, kwargs)
    static = "export made the batch static: the model's code depends on its size"
    failures: list[str] = []
    if rows is None:
        tries, why = [], "no tensor input has a batch dimension that forward() names"
    elif rows < 2:  # sizes 0 and 1 are export's constants: the lengths alone
        tries, why = [(False, True)], "an example batch of one row: export takes sizes 0 and 1 as constants"
    else:
        tries, why = [(True, True), (True, False), (False, True)], ""
    tried = set()
    for batch, lengths in tries:
        shapes = _dynamic_shapes(model, args, kwargs, batch, lengths)
        if shapes is None:
            why = why or "no tensor input has a batch dimension that forward() names"
            break
        if _no_dynamic(shapes) or repr(shapes) in tried:  # an image model's lengths: nothing to try
            continue
        tried.add(repr(shapes))
        try:
            with _marks_kept(args, kwargs):
                ep = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=shapes)
        except Exception as e:  # noqa: BLE001 (export's reason is the note; the next try decides)
            failures.append(f"export with {_dynamic_text(batch, lengths)} dynamic failed: {_first_line(e)}")
            continue
        check_positions(ep)
        found = dynamic_sizes(ep, args, kwargs)  # None: export made every size static, its program is the static one
        static_why = why or "; ".join(failures) or static
        return ep, found, "" if found is not None and found.batch is not None else static_why
    with _marks_kept(args, kwargs):
        ep = torch.export.export(model, args, kwargs, strict=False)
    check_positions(ep)
    return ep, None, why or "; ".join(failures) or static


def check_positions(ep) -> None:
    """Raise where the example itself is past a position table's rows (eager would raise IndexError)."""
    for symbol, size, limit in position_limits(ep):
        if size is not None and size > limit.longest:
            name = "a sequence length of the example" if symbol is None else "the example's sequence length"
            raise SizeError(past_limit(name, size, limit) + ".")


def _dynamic_text(batch: bool, lengths: bool) -> str:
    return "the batch and the lengths" if batch and lengths else "the batch" if batch else "the lengths"


def _no_dynamic(shapes: dict) -> bool:
    return all(spec is None for spec in pytree.tree_leaves(shapes, is_leaf=lambda v: isinstance(v, dict) and (
        not v or all(isinstance(k, int) for k in v))))


# torch.export marks the inputs it is given a dynamic size on (Dim.AUTO sets the dims' weak-dynamic
# marks) and a failed export leaves the marks: the next export, asked for no dynamic size, then
# traces those dims symbolically anyway. Each try starts and ends with the inputs' own marks.
_MARKS = ("_dynamo_weak_dynamic_indices", "_dynamo_dynamic_indices", "_dynamo_dynamic_range",
          "_dynamo_static_indices", "_dynamo_unbacked_indices", "_has_dynamo_dim_marking")


@contextlib.contextmanager
def _marks_kept(args: tuple, kwargs: dict):
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    saved = [{k: v for k, v in vars(t).items() if k in _MARKS} for t in tensors]
    try:
        yield
    finally:
        for t, marks in zip(tensors, saved):
            for k in _MARKS:
                if k in marks:
                    setattr(t, k, marks[k])
                elif k in vars(t):
                    delattr(t, k)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _leaf_name(path) -> str:
    """'argument 1', 'labels', 'past[0]': a leaf of (args, kwargs) as the caller wrote it."""
    where, first, *rest = path
    head = f"argument {first.idx + 1}" if where.idx == 0 else str(first.key)
    return head + "".join(str(k) for k in rest)


def _bounds(ep, symbol) -> SizeRange | None:
    bounds = ep.range_constraints.get(symbol)
    if bounds is None:
        return None
    try:
        upper = int(bounds.upper)
    except (TypeError, ValueError, OverflowError, AttributeError):  # torch's int_oo: no upper bound
        upper = None
    return SizeRange(max(int(bounds.lower), 2), upper)


def dynamic_sizes(ep, args: tuple, kwargs: dict) -> DynamicSizes | None:
    """The sizes of ep's user inputs that export kept dynamic, named (DynamicSizes); None when
    it kept none. Dim 0 of every input is the batch: Dim.AUTO gives inputs the model never
    relates symbols of their own, and the guard asks them to share one size (the intersection
    of their ranges). A size export relates to others by an expression, not a symbol of its
    own, is taken at the example's value."""
    leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
    user_inputs = ep.graph_signature.user_inputs
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    if len(user_inputs) != len(leaves):
        return None
    names, by_symbol, ranges = [], {}, {}
    limits = {}
    for symbol, _, limit in position_limits(ep):
        if symbol is not None and (symbol not in limits or limit.longest < limits[symbol].longest):
            limits[symbol] = limit
    for (path, leaf), input_name in zip(leaves, user_inputs):
        val = placeholders[input_name].meta.get("val") if input_name in placeholders else None
        if not isinstance(leaf, torch.Tensor) or not isinstance(val, torch.Tensor):
            names.append(None)
            continue
        dims = []
        for d, size in enumerate(val.shape):
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            found = _bounds(ep, expr) if expr is not None and expr.is_Symbol else None
            if found is None:
                dims.append(None)
                continue
            if expr in limits:
                found = found.within(limits[expr])
            name = BATCH if d == 0 else by_symbol.setdefault(expr, f"dim {d} of {_leaf_name(path)}")
            was = ranges.get(name)
            ranges[name] = found if was is None else was.both(found)
            dims.append(name)
        names.append(tuple(dims))
    if not ranges:
        return None
    ordered = sorted(ranges.items(), key=lambda item: item[0] != BATCH)
    return DynamicSizes(tuple(names), tuple(ordered))


def guards_failure(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> str | None:
    """Run the checks of sizes torch.export put in its module gm (the `_guards_fn` submodule the
    graph calls on its inputs first: related sizes, an even batch) on a call; the failure, or
    None. Placeholders are the call's pytree leaves, as export flattens them."""
    node = next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"), None)
    if node is None:
        return None
    values = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], program_inputs(gm, args, kwargs)))
    try:
        gm.get_submodule("_guards_fn")(*[values.get(a, a) for a in node.args])
    except AssertionError as e:
        if not str(e).startswith("Guard failed"):
            raise
        return str(e)
    return None


class ExportCache:
    """Exported programs kept for calls of other sizes (the lazy form's new lengths): a program
    whose dynamic sizes take a call serves it, through a fresh `ep.module()`, without a new
    export (the slowest step of a plan). Kept by the model's mode, the call's kind (structure,
    dtypes, devices, other values) and the identity, dtype, device and shape of the model's
    parameters and buffers (a program holds the tensors it was exported with, as they were: a
    model converted in place, `model.half()`, is exported again). At most `size`, the oldest
    dropped first."""

    def __init__(self, size: int = 8):
        self.size = size
        self._kept: OrderedDict = OrderedDict()

    @staticmethod
    def _key(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        state = tuple((id(t), t.dtype, t.device, t.shape) for t in (*model.parameters(), *model.buffers()))
        return model.training, signature(args, kwargs, shapes=False), state

    def get(self, model: torch.nn.Module, args: tuple, kwargs: dict):
        """(ExportedProgram, DynamicSizes, why static) exported for another call whose dynamic
        sizes take this one; None where none does (export's related-size checks are the
        caller's, on the module: guards_failure)."""
        kept = self._kept.get(self._key(model, args, kwargs))
        if kept is None:
            return None
        ep, sizes, why, example = kept
        if sizes.why_not(example, pytree.tree_leaves((args, kwargs))) is not None:
            return None
        return ep, sizes, why

    def put(self, model: torch.nn.Module, args: tuple, kwargs: dict, ep, sizes, why: str) -> None:
        """Keep ep for later calls, where it has dynamic sizes and no custom autograd Function
        (whose graph stand-ins are replaced once, custom_functions.restore)."""
        if sizes is None or any("autograd_function" in str(n.target) for n in ep.graph.nodes):
            return
        key = self._key(model, args, kwargs)
        self._kept[key] = (ep, sizes, why, pytree.tree_leaves((args, kwargs)))
        self._kept.move_to_end(key)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)


_KEPT: contextvars.ContextVar[ExportCache | None] = contextvars.ContextVar("graphopt_exports", default=None)


@contextlib.contextmanager
def keeping_exports(cache: ExportCache):
    """While open, trace() takes its exports from `cache` and keeps new ones there (the lazy
    form's builds, train_step's plans for each microbatch count)."""
    token = _KEPT.set(cache)
    try:
        yield cache
    finally:
        _KEPT.reset(token)


def kept_exports() -> ExportCache | None:
    return _KEPT.get()
