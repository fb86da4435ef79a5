"""Checks installed on an optimized module so that it is never silently wrong.

Tracing bakes the module's train/eval mode into the graph (dropout, BatchNorm, any
`if self.training:`), and some passes plan for the example shapes. A call that does not
match what the graph was built for raises instead of computing something else.

The checks are bound once per call signature, as the fused calls are: install_guards ends by
gathering every pre-call check into one forward pre-hook (CallGuards) that runs the checks a
call's signature alone decides (by_signature: its arguments' kinds, shapes, export's own input
checks, the passes' budget and causal-mask checks) once per signature and skips them for a
signature that passed, and runs the others (the modules' mode, inputs that share storage) at
every call.
"""
from __future__ import annotations

import functools
import os
import sys
import inspect

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..analysis.planning_device import seen_as
from ..errors import GraphoptError, ModeError, SizeError, UsageError, traced_kinds_refused
from ..frontend.batch import batch_rows
from ..frontend.call_signature import signature
from ..frontend.export_batch import guards_failure
from .microbatch_call import install_microbatch_split


def sizes_refused(message: str) -> UsageError:
    """The UsageError of a call at sizes the graph does not take (its shape or sizes guard refused
    it before running anything), marked so: runtime/batch_graphs.py builds another graph on it,
    for another batch. The user sees a UsageError like any other."""
    error = UsageError(message)
    error.sizes_refused = True
    return error


def refusal(module: torch.nn.Module, args: tuple, kwargs: dict) -> Exception | None:
    """The error module's checks before a call (its forward pre-hooks: every guard here, and the
    passes' call checks) raise for this call, without running it; None when they pass."""
    for key, hook in list(module._forward_pre_hooks.items()):
        try:
            if key in module._forward_pre_hooks_with_kwargs:
                result = hook(module, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(module, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        except GraphoptError as e:
            return e
    return None


_BY_SIGNATURE = "graphopt_by_signature"
_SCALARS = (bool, int, float, str)


def by_signature(hook):
    """Mark a pre-call check whose outcome (passing, raising, the call it hands on) the call's
    signature decides alone: CallGuards runs it once per signature."""
    setattr(hook, _BY_SIGNATURE, True)
    return hook


def _decided_by_signature(hook) -> bool:
    from torch.export import _unlift  # noqa: PLC0415  (export's own check of its inputs' spec and sizes)

    return getattr(hook, _BY_SIGNATURE, False) or hook is getattr(_unlift, "_check_input_constraints_pre_hook", None)


def call_key(args: tuple, kwargs: dict) -> tuple | None:
    """A call's signature, made fast: per argument its tensor's shape, dtype and device, or the
    value of a None, bool, int, float or str; None for a call with any other argument (a
    container: its checks run every time)."""
    parts = [len(args)]
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            parts.append((value.shape, value.dtype, value.device))
        elif value is None or type(value) in _SCALARS:
            parts.append((type(value), value))
        else:
            return None
    parts.extend(kwargs)
    return tuple(parts)


class CallGuards:
    """Every pre-call check of a module as one forward pre-hook, in the order they were installed
    (hooks: (hook, with_kwargs)); the ones by_signature marks run once per call signature."""

    def __init__(self, hooks: list):
        self.hooks = [(hook, with_kwargs, _decided_by_signature(hook)) for hook, with_kwargs in hooks]
        self.passed: set = set()  # call_keys that passed every check by_signature marks

    def __call__(self, module, args: tuple, kwargs: dict):
        key = call_key(args, kwargs)
        known = key is not None and key in self.passed
        changed = rewritten = False
        for hook, with_kwargs, decided in self.hooks:
            if known and decided:
                continue
            result = hook(module, args, kwargs) if with_kwargs else _positional(hook(module, args), kwargs)
            if result is not None:
                args, kwargs = result
                changed = True
                rewritten = rewritten or decided  # what such a check hands on is this call's own
        if key is not None and not known and not rewritten:
            self.passed.add(key)
        return (args, kwargs) if changed else None


def _positional(result, kwargs):
    """A hook without kwargs returns the new positional arguments, a tuple or one value."""
    return None if result is None else ((result if isinstance(result, tuple) else (result,)), kwargs)


def gather_guards(module: torch.nn.Module) -> CallGuards:
    """Replace the module's forward pre-hooks by one CallGuards running them in their order."""
    hooks = [(hook, key in module._forward_pre_hooks_with_kwargs) for key, hook in module._forward_pre_hooks.items()]
    module._forward_pre_hooks.clear()
    module._forward_pre_hooks_with_kwargs.clear()
    guards = CallGuards(hooks)
    module.register_forward_pre_hook(guards, with_kwargs=True)
    return guards


def install_mode_guard(gm: torch.fx.GraphModule, training: bool) -> None:
    """Raise ModeError when gm (or any submodule it shares with the model) is in the other mode."""
    modules = list(gm.modules())
    built_for = "training" if training else "inference"
    other = "model.eval()" if training else "model.train()"

    def check(module, args, kwargs):
        if any(m.training != training for m in modules):
            raise ModeError(
                f"this graphopt module was built for {built_for} (its graph bakes in dropout and "
                f"BatchNorm behaviour), but it or a module it shares is now in the other mode. "
                f"For the other mode build another one, e.g. graphopt.optimize({other}, example_inputs, "
                f"train={not training}), or use graphopt.optimize(model) without example inputs, "
                "which rebuilds on a mode change."
            )

    gm.register_forward_pre_hook(check, with_kwargs=True)


REPLAN = ("call it with inputs of those shapes, or use graphopt.optimize(model) without example inputs, "
          "which builds another graph where none it has takes a call.")


def _one(value) -> str:
    """A value of a call, short: 'float32[4, 8]', '(int64[2], float32[2])', 'None', '3'."""
    leaves = pytree.tree_leaves(value)
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}[{', '.join(map(str, value.shape))}]"
    if any(isinstance(t, torch.Tensor) for t in leaves):
        return "(" + ", ".join(_one(t) for t in leaves) + ")"
    text = repr(value)
    return text if len(text) <= 40 else f"{type(value).__name__}"


def _arguments(args: tuple, kwargs: dict) -> dict[str, str]:
    return {**{f"argument {i + 1}": _one(a) for i, a in enumerate(args)}, **{k: _one(v) for k, v in kwargs.items()}}


def describe_call(args: tuple, kwargs: dict) -> str:
    """The arguments of a call, short: 'float32[4, 8], input_ids=int64[4, 16], labels=None'."""
    return ", ".join([_one(a) for a in args] + [f"{k}={_one(v)}" for k, v in kwargs.items()])


def changes(before: tuple[tuple, dict], after: tuple[tuple, dict]) -> str:
    """What differs between two calls, argument by argument: 'labels: int64[2, 16] -> None'."""
    a, b = _arguments(*before), _arguments(*after)
    diffs = [f"{k}: {a.get(k, 'not given')} -> {b.get(k, 'not given')}" for k in {**a, **b} if a.get(k) != b.get(k)]
    return "; ".join(diffs) or "the same shapes, another structure"


def install_shape_guard(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, reason: str, advice: str = REPLAN,
                        also: tuple[tuple, dict] | None = None) -> None:
    """Raise when gm is called with other shapes than it was planned for (a pass said so), or
    than `also`'s, a second call it takes."""
    expected, shapes = {signature(args, kwargs)}, describe_call(args, kwargs)
    if also is not None:
        expected.add(signature(*also))
        shapes += f" (or {describe_call(*also)})"

    @by_signature
    def check(module, call_args, call_kwargs):
        if signature(call_args, call_kwargs) not in expected:
            changed = changes((args, kwargs), (call_args, call_kwargs))
            raise sizes_refused(f"this graphopt module was built for inputs {shapes} ({reason}), and got "
                                f"{describe_call(call_args, call_kwargs)} ({changed}); {advice}")

    gm.register_forward_pre_hook(check, with_kwargs=True)


def install_sizes_guard(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, sizes) -> None:
    """Raise when gm is called with other sizes than `sizes` (export_batch.DynamicSizes) takes: the
    example's where export kept a size static, within the range export proved where it kept it
    dynamic (a branch the model took for the example holds inside it only), one batch for all
    inputs. Dtypes, devices and other values are install_call_guard's."""
    example = pytree.tree_leaves((args, kwargs))
    shapes = describe_call(args, kwargs)

    def refuse(call_args, call_kwargs, why):
        return sizes_refused(f"this graphopt module runs at {sizes}, other sizes as in the example inputs {shapes} "
                          f"(torch.export traced it so), and got {describe_call(call_args, call_kwargs)}: {why}; "
                          f"{REPLAN}")

    @by_signature
    def check(module, call_args, call_kwargs):
        call = pytree.tree_leaves((call_args, call_kwargs))
        past = sizes.past_model(call) if len(call) == len(example) else None
        if past is not None:  # no graph takes it: not a sizes_refused for another graph to take
            raise SizeError(f"this graphopt module got {describe_call(call_args, call_kwargs)}: {past}.")
        why = sizes.why_not(example, call) if len(call) == len(example) else \
            f"another structure of inputs ({changes((args, kwargs), (call_args, call_kwargs))})"
        if why is not None:
            raise refuse(call_args, call_kwargs, why)

    @by_signature
    def related(module, call_args, call_kwargs):
        why = guards_failure(gm, call_args, call_kwargs)
        if why is not None:
            raise refuse(call_args, call_kwargs, why)

    # before export's own input checks, which raise bare AssertionErrors
    gm.register_forward_pre_hook(check, with_kwargs=True, prepend=True)
    # Inside the ranges, export's graph checks what a range cannot say (a batch the model needs
    # even, two sizes whose product must match) as its first step, before computing anything.
    # `related` runs that step (export_batch.guards_failure) after the guards installed so far
    # (the call guard: the inputs are of the example's kinds) and before the passes' call checks
    # (a budget's estimate at the call's sizes); where a torch keeps it elsewhere, its failure
    # is the user's call.
    gm.register_forward_pre_hook(related, with_kwargs=True)
    translate_failures(gm, AssertionError, ("Guard failed",), lambda a, k, e: refuse(a, k, f"{e}"))


def translate_failures(gm: torch.fx.GraphModule, caught: type, says: tuple[str, ...], refusal) -> None:
    """Raise refusal(call_args, call_kwargs, error) where gm's graph raises a `caught` whose message
    starts with one of `says`: torch's bare error from a check inside the graph, said as graphopt's.
    One wrapper of gm's forward holds every translation: a call pays one frame, and nothing more
    unless it fails."""
    cls = type(gm)  # fx makes a class per GraphModule: the wrapper touches no other module
    if "_graphopt_translations" not in cls.__dict__:
        plain = cls.forward

        @functools.wraps(plain)  # the signature stays the graph's: placeholder_values binds calls by it
        def forward(self, *call_args, **call_kwargs):
            try:
                return plain(self, *call_args, **call_kwargs)
            except Exception as e:
                for kind, starts, make in cls._graphopt_translations:
                    if isinstance(e, kind) and str(e).startswith(starts):
                        raise make(call_args, call_kwargs, e) from None
                raise

        cls.forward, cls._graphopt_translations = forward, ()
    cls._graphopt_translations += ((caught, says, refusal),)


def _kind(leaf, value: bool):
    """A tensor's dtype and device (the passes plan for them); with value, any other leaf's value,
    else only None told apart from other values."""
    if isinstance(leaf, torch.Tensor):
        return ("tensor", leaf.dtype, seen_as(leaf.device).type)
    if not value:
        return "None" if leaf is None else "value"
    try:
        hash(leaf)
        return ("value", leaf)
    except TypeError:
        return ("value", repr(leaf))


def _kinds(bound: dict, constants: set[str]) -> dict[str, tuple]:
    """Per argument, its containers and the kind of each leaf (_kind); the values of `constants`.
    A tensor, None or a number is its own leaf: flattening it costs more than the call's other checks."""
    kinds = {}
    for name, value in bound.items():
        if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
            kinds[name] = (None, (_kind(value, name in constants),))
        else:
            leaves, spec = pytree.tree_flatten(value)
            kinds[name] = (spec, tuple(_kind(leaf, name in constants) for leaf in leaves))
    return kinds


def _without(signature: inspect.Signature, names: set[str], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call without the arguments `names` (the example's defaults, given again: the fx graph
    holds them already); positional arguments after the first dropped one go by keyword."""
    positional = list(signature.parameters)[:len(args)]
    first = next((i for i, p in enumerate(positional) if p in names), len(args))
    moved = {p: a for p, a in zip(positional[first:], args[first:]) if p not in names}
    return args[:first], {**moved, **{k: v for k, v in kwargs.items() if k not in names}}


def install_call_guard(gm: torch.fx.GraphModule, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Raise UsageError when gm is called with arguments the model's forward() would not take
    (naming its signature: the graph's own forward has other parameter names), or with other
    kinds of arguments than the example's, defaults filled in: a tensor where it gave None
    (`labels=None`), a tensor of another dtype or device, another container, and another value
    where the graph holds the example's as a constant: every non-tensor of an export graph, and
    the arguments the example left at their default in an fx graph (which bakes those in and
    takes them no more: a call that gives one its default has it dropped)."""
    try:
        expected = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C++ forward: nothing to compare with
        return
    name = type(model).__name__
    given = expected.bind(*args, **kwargs).arguments
    export = gm.meta.get("graphopt_frontend") == "export"
    baked = set() if export else {k for k in expected.parameters if k not in given}

    def bound(call_args, call_kwargs) -> tuple[dict, set[str]]:
        """The call's arguments, defaults filled in, and the names it gave."""
        b = expected.bind(*call_args, **call_kwargs)
        named = set(b.arguments)
        b.apply_defaults()
        return b.arguments, named

    was, _ = bound(args, kwargs)
    constants = set(was) if export else baked
    example = _kinds(was, constants)

    @by_signature
    def check(module, call_args, call_kwargs):
        try:
            got, named = bound(call_args, call_kwargs)
        except TypeError as e:
            raise UsageError(f"this graphopt module takes the arguments of {name}.forward{expected}, "
                             f"and this call does not fit: {e}. Call it as you call the model.") from None
        kinds = _kinds(got, constants)
        if kinds != example:
            names = [k for k in example if kinds.get(k) != example[k]]
            diff = "; ".join(f"{k}: {_one(was[k])} -> {_one(got[k])}" for k in names)
            raise UsageError(
                f"this graphopt module was traced for {name}.forward called with {describe_call((), was)}, and this "
                f"call gives other kinds of arguments ({diff}): the graph computes what the model does with the "
                "example's kinds only. Call it with arguments of those kinds, or use graphopt.optimize(model) "
                "without example inputs, which builds a graph for each kind of call.")
        if baked & named:
            return _without(expected, baked, call_args, call_kwargs)
        return None

    gm.register_forward_pre_hook(check, with_kwargs=True, prepend=True)


SAVE_ADVICE = ("graphopt modules cannot be pickled (torch.save, pickle): their graphs call "
               "generated kernels and recompute segments that are rebuilt, not stored. Save the model's "
               "state_dict() (this module shares its parameters and buffers), and after loading it into the "
               "model call graphopt.optimize again.")


def refused_save() -> UsageError:
    """The refusal to pickle a graphopt module, raised from inside pickling. Under torch.save to a
    path the file is already open and partly written: it is removed first, so a refused save
    leaves no file behind (the open writer goes on into an unlinked file, closed as it unwinds)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not torch.serialization.save.__code__:
        frame = frame.f_back
    path = frame.f_locals.get("f") if frame is not None else None
    if isinstance(path, str) and os.path.isfile(path):
        os.unlink(path)
    return UsageError(SAVE_ADVICE)


def refuse_pickling(module: torch.nn.Module) -> None:
    """Make pickling `module` raise UsageError with SAVE_ADVICE. A GraphModule has a class of its
    own (fx makes one per instance), so the refusal touches no other module."""
    def refuse(self, protocol=None):
        raise refused_save()

    type(module).__reduce_ex__ = refuse
    type(module).__reduce__ = refuse


# how aten._assert_tensor_metadata, export's check of a value's dtype or device before a .to(), fails
_KIND_MISMATCH = ("Tensor dtype mismatch", "Tensor device mismatch", "Tensor layout mismatch")


def install_kinds_translation(gm: torch.fx.GraphModule) -> None:
    """Turn a failure of export's dtype and device checks inside the graph (a value of another
    dtype than traced: a call under torch.autocast, a model cast after optimize) into the
    UsageError that says what to do, where torch raises a bare RuntimeError."""
    translate_failures(gm, RuntimeError, _KIND_MISMATCH,
                       lambda a, k, e: traced_kinds_refused(f"a value of this call is not as traced ({e})"))


def install_guards(gm: torch.fx.GraphModule, model: torch.nn.Module, given: tuple[tuple, dict],
                   example: tuple[tuple, dict], batch: tuple[tuple, dict], microbatches: int | None,
                   specialized: str | None, call_checks: list, writes, loss=None) -> str:
    """Every check a call of optimize()'s result passes first, in order: its mode, its arguments'
    kinds (given: the call as the user wrote it), export's dtype checks' failures said as a
    UsageError, writes into aliased inputs, pickling refused,
    the shapes it runs at (example: what the passes planned for, one microbatch where stages run
    the batch as microbatches), then the passes' own call checks, whose reasons come after the
    shapes'. loss: the graph's scalar loss (analysis/batch_wide.LossReduction), by whose reduction
    a staged graph called with the full batch combines its microbatches' losses. Returns which
    inputs the result takes, for the report."""
    install_mode_guard(gm, model.training)
    install_call_guard(gm, model, *given)
    if gm.meta.get("graphopt_frontend") == "export":
        install_kinds_translation(gm)
    if writes.written:
        gm.register_forward_pre_hook(writes, with_kwargs=True)
    refuse_pickling(gm)
    if microbatches:
        runs_at = _staged_shapes(gm, example, batch, microbatches, loss)
    else:
        runs_at = _shapes(gm, example, specialized)
    for check in call_checks:
        gm.register_forward_pre_hook(by_signature(check), with_kwargs=True)
    gather_guards(gm)
    return runs_at


def _staged_shapes(gm: torch.fx.GraphModule, example: tuple[tuple, dict], batch: tuple[tuple, dict],
                   microbatches: int, loss) -> str:
    """Stages planned for one microbatch: called with the example batch, the graph runs its
    microbatches as PipelineRunner would; an export graph takes its microbatch's sizes, or its
    dynamic ones."""
    args, kwargs = example
    rows = batch_rows(*batch)
    install_microbatch_split(gm, rows, microbatches, loss)
    runs_at = f"one microbatch of {batch_rows(args, kwargs)} rows, or the example batch of {rows} rows " \
              f"as {microbatches} microbatches"
    if gm.meta["graphopt_frontend"] != "export":
        return runs_at + " (and any other batch as one piece)"
    if gm.meta["graphopt_batch"] is None:
        install_shape_guard(
            gm, args, kwargs, f"an export graph staged for one microbatch, 1/{microbatches} of the example batch",
            "call it with the example batch, which it splits into its microbatches, on one microbatch, or "
            "through graphopt.runtime.pipeline.PipelineRunner; frontend='fx' makes a graph that runs at any "
            "batch size.", also=batch)
        return runs_at
    install_sizes_guard(gm, args, kwargs, gm.meta["graphopt_sizes"])
    return runs_at + f" (and any other batch as one piece: {gm.meta['graphopt_sizes']})"


def _shapes(gm: torch.fx.GraphModule, example: tuple[tuple, dict], specialized: str | None) -> str:
    """A graph a pass specialized to the example's shapes takes those; an export graph its
    dynamic sizes, or the example's where export made none; an fx graph any."""
    args, kwargs = example
    if specialized:
        install_shape_guard(gm, args, kwargs, specialized)
        return f"the example's shapes only: {specialized}"
    if gm.meta["graphopt_frontend"] != "export":
        return "any shapes the model takes (torch.fx)"
    if gm.meta["graphopt_sizes"] is not None:
        install_sizes_guard(gm, args, kwargs, gm.meta["graphopt_sizes"])
        sizes = gm.meta["graphopt_sizes"]
        static = f"; {gm.meta['graphopt_static_why']}" if sizes.batch is None else ""
        return f"{sizes} (torch.export, dynamic sizes{static})"
    install_shape_guard(
        gm, args, kwargs, "torch.export traced it for those shapes",
        "call it with inputs of those shapes, use graphopt.optimize(model) without example inputs, which "
        "builds a graph per input signature, or frontend='fx' where the model traces with it.")
    return f"the example's shapes only: torch.export could not make the batch dynamic ({gm.meta['graphopt_static_why']})"
