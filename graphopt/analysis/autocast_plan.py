"""Analysis for the precision pass: the dtype each op runs in under torch.autocast's rules, and
the casts the graph needs for it. Nothing here changes the graph.

An op's mode (what it does with its floating inputs):
  low      every floating input cast to the low dtype     (the registry's "lower" class)
  fp32     every floating input cast to float32           ("fp32")
  promote  every floating input cast to the widest one    ("promote")
  follow   inputs as they come, the op's own promotion    (None: autocast leaves them alone too)
  autocast inputs as they come, the call run under         (ops the registry does not know, on tensors:
           torch.autocast itself                          what they hold only autocast can cast)
  check    not run: an assertion the trace recorded (the pass restates the dtypes it names)
  original inputs in the dtypes of the original graph     (a node that rejects the others on
                                                          FakeTensors, or a module the pass cannot rewrite)
Like autocast, only float32, float16 and bfloat16 tensors are cast: never float64, integer
indices or boolean masks.

plan() runs the graph on FakeTensors, the planned casts applied to the fake values only, so
every node's new output dtype comes from torch itself, not from rules of thumb.

Constants of the traced dtype: a model writes `x.masked_fill(mask, torch.finfo(x.dtype).min)`,
and the trace keeps float32's minimum as a number. Under autocast x is bf16 and Python asks
finfo again; in the graph the number stays, and float32's minimum overflows bf16 (masked_fill
raises, where gives -inf). A number argument of a node whose result the plan narrows is
therefore read as what finfo said of the result's traced dtype when it equals one of finfo's
limits (max, min, tiny, eps), and becomes what finfo says of the new one (`dtype_constants`).
"""
from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.node import map_arg

from .. import ops
from ..ops.variants import VARIANT_OF
from .fake_state import fake_run
from .meta import TensorInfo, describe_value, tensor_info

MODES = ("low", "fp32", "promote", "follow")  # what a policy may ask for
ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)
_MODE_OF_CLASS = {"lower": "low", "fp32": "fp32", "promote": "promote", None: "follow"}
_AUTOCAST_KEYS = {name[len("Autocast"):].lower(): name for name in dir(torch._C.DispatchKey) if name.startswith("Autocast")}


@functools.lru_cache(maxsize=None)
def device_class(op_name: str, device: str) -> str | None:
    """The registry's autocast class of an op, as autocast on `device` applies it.

    The registry's classes are CUDA's lists. Other devices' autocast lists fewer ops (on CPU,
    softmax and layer_norm run in their input's dtype); the dispatcher says whether the device's
    autocast has a kernel for one of the op's ATen overloads. An op without one is cast only
    through what it decomposes into: the matmul-like composites (einsum, ...) reach mm and bmm,
    which every device lowers; any other runs in its inputs' dtype. Ops whose spellings name no
    ATen overload keep the registry's class.
    """
    op = ops.canonical_ops()[op_name]
    key = _AUTOCAST_KEYS.get(device)
    if op.precision is None or device == "cuda" or key is None:
        return op.precision
    overloads = [t for t in ops.targets_of(op.name) if isinstance(t, torch._ops.OpOverload)]
    if not overloads:
        return op.precision
    if any(_has_kernel(o, key) for o in overloads):
        return op.precision
    composite = any(_has_kernel(o, "CompositeImplicitAutograd") for o in overloads)
    return "lower" if op.precision == "lower" and composite else None


def _has_kernel(overload, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), key)
    except RuntimeError:  # TorchScript-only overloads (aten::sum.int) are not in the dispatcher
        return False


def op_mode(node: torch.fx.Node, gm: torch.fx.GraphModule, device: str, policy: dict[str, str]) -> str:
    """What the node does with its floating inputs: one of MODES, or "check"."""
    op = ops.lookup(node, gm)
    if op is None:
        return "autocast" if any(tensor_info(n) is not None for n in (node, *node.all_input_nodes)) else "follow"
    if op.is_check:
        return "check"
    for name in (op.name, VARIANT_OF.get(op.name)):
        if name in policy:
            return policy[name]
    mode = _MODE_OF_CLASS[device_class(op.name, device)]
    if mode == "fp32" and "dtype" in dict(op.params):
        # autocast runs softmax(x, dtype=...), sum(x, dtype=...) as called when a dtype is given
        bound = ops.bind(node, gm)
        if bound is not None and bound.params.get("dtype") is not None:
            return "follow"
    return mode


@dataclass
class AutocastPlan:
    modes: dict[torch.fx.Node, str] = field(default_factory=dict)
    casts: dict[torch.fx.Node, dict[torch.fx.Node, torch.dtype]] = field(default_factory=dict)  # consumer -> {input: dtype}
    infos: dict[torch.fx.Node, object] = field(default_factory=dict)  # TensorInfo(s) of each node after the casts
    # node -> {number in the trace: the number for the node's new dtype} (finfo's limits)
    constants: dict[torch.fx.Node, dict[float, float]] = field(default_factory=dict)
    declined: dict[str, str] = field(default_factory=dict)  # node -> why it keeps its original input dtypes


def _wanted(mode: str, inputs: dict, low: torch.dtype, original: dict) -> dict:
    floats = {n: v.dtype for n, v in inputs.items() if isinstance(v, torch.Tensor) and v.dtype in ELIGIBLE}
    if mode in ("follow", "autocast"):
        return {}
    if mode == "original":
        return {n: original[n] for n, d in floats.items() if n in original and original[n] != d}
    if mode == "promote":
        widest = None
        for v in inputs.values():
            if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
                widest = v.dtype if widest is None else torch.promote_types(widest, v.dtype)
        target = widest
    else:
        target = low if mode == "low" else torch.float32
    return {n: target for n, d in floats.items() if d != target}


class _Planner(torch.fx.Interpreter):
    """Runs the graph on FakeTensors, casting each node's fake inputs as its mode asks."""

    def __init__(self, gm, plan: AutocastPlan, modes: dict, low: torch.dtype, original: dict, device: str):
        super().__init__(gm, garbage_collect_values=False)
        self.plan, self.modes, self.low, self.original, self.device = plan, modes, low, original, device

    def run_node(self, n):
        if n.op not in ("call_function", "call_method", "call_module"):
            value = super().run_node(n)
            self.plan.infos[n] = describe_value(value)
            return value
        mode = self.modes[n]
        if mode == "check":
            self.plan.modes[n] = mode
            return None
        inputs = {x: self.env[x] for x in n.all_input_nodes}
        casts = _wanted(mode, inputs, self.low, self.original)
        try:
            if mode == "autocast":
                with torch.autocast(self.device, dtype=self.low):
                    value = self._call(n, casts)
            else:
                value = self._call(n, casts)
        except Exception as e:  # the op does not take these dtypes: it keeps the original ones
            self.plan.declined[n.name] = f"{mode} inputs rejected ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
            mode, casts = "original", _wanted("original", inputs, self.low, self.original)
            value = self._call(n, casts)
        self.plan.modes[n], self.plan.infos[n] = mode, describe_value(value)
        if casts:
            self.plan.casts[n] = casts
        traced, now = self.original.get(n), value.dtype if isinstance(value, torch.Tensor) else None
        if traced in ELIGIBLE and now in ELIGIBLE and now != traced:
            constants = dtype_constants(n, traced, now)
            if constants:
                self.plan.constants[n] = constants
        return value

    def _call(self, n, casts):
        def fetch(x):
            v = self.env[x]
            return v.to(casts[x]) if x in casts else v

        args, kwargs = map_arg(n.args, fetch), map_arg(n.kwargs, fetch)
        return getattr(self, n.op)(n.target, args, kwargs)


def _limits(dtype: torch.dtype) -> list[float]:
    info = torch.finfo(dtype)
    return [info.max, info.min, info.tiny, info.eps, -info.tiny, -info.eps]


def dtype_constants(node: torch.fx.Node, traced: torch.dtype, now: torch.dtype) -> dict[float, float]:
    """The number arguments of `node` that equal one of finfo(traced)'s limits, each mapped to
    finfo(now)'s same limit: what `torch.finfo(x.dtype).min` evaluates to when x is `now`."""
    new = dict(zip(_limits(traced), _limits(now)))
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    return {a: new[a] for a in flat if type(a) is float and a in new}


def plan(gm: torch.fx.GraphModule, flat_inputs: list, low: torch.dtype, modes: dict, device: str) -> AutocastPlan:
    """Where the graph needs casts so that each node runs in its mode, and every node's dtype after.

    `modes` maps each call node to its mode (op_mode). The original input dtypes, for "original"
    nodes, come from the graph's TensorInfo.
    """
    original = {}
    for node in gm.graph.nodes:
        info = tensor_info(node)
        if info is not None and not isinstance(info, tuple):
            original[node] = info.dtype
    result = AutocastPlan()
    with fake_run(gm, flat_inputs) as (fake_mode, fake_inputs), fake_mode:
        _Planner(gm, result, modes, low, original, device).run(*fake_inputs)
    return result


def dtypes_of(value):
    """The dtype of a tensor or TensorInfo; a tuple of them for a tuple; None for anything else."""
    if isinstance(value, (torch.Tensor, TensorInfo)):
        return value.dtype
    if isinstance(value, (tuple, list)):
        found = tuple(dtypes_of(v) for v in value)
        return found if any(d is not None for d in found) else None
    return None


def autocast_dtypes(gm: torch.fx.GraphModule, flat_inputs: list, dtype: torch.dtype, device: str) -> dict[str, object]:
    """Each node's output dtype (a tuple for tuple outputs) when gm really runs, node by node,
    under torch.autocast(device, dtype): the reference the pass is tested and benchmarked against.

    Export's dtype assertions of the float32 trace are skipped: autocast breaks them by design.
    """
    seen = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            value = None if n in checks else self._run(n)
            seen[n.name] = dtypes_of(value)
            return value

        def _run(self, n):
            try:
                return super().run_node(n)
            except RuntimeError:
                # a number the trace took from finfo of a float32 input that autocast narrowed
                # (eager asks finfo again): the dtypes, all this records, are the same with either
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                traced = dtypes_of(tensor_info(n))
                now = next((t.dtype for t in pytree.tree_leaves((args, kwargs))
                            if isinstance(t, torch.Tensor) and t.dtype in ELIGIBLE), None)
                constants = dtype_constants(n, traced, now) if traced in ELIGIBLE and now in ELIGIBLE else {}
                if not constants:
                    raise
                args, kwargs = pytree.tree_map_only(float, lambda v: constants.get(v, v), (args, kwargs))
                return getattr(self, n.op)(n.target, args, kwargs)

    checks = {n for n in gm.graph.nodes if (op := ops.lookup(n, gm)) is not None and op.is_check}
    with torch.autocast(device, dtype=dtype):
        Record(gm).run(*flat_inputs)
    return seen


def parse_policy(value) -> str:
    """A policy, from a dict or 'op:mode;op:mode' text, as sorted canonical text."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, str):
        items = []
        for part in filter(None, (p.strip() for p in value.split(";"))):
            name, colon, mode = part.partition(":")
            if not colon:
                raise ValueError(f"write each entry as op:mode, e.g. softmax:low;linear:fp32 (got {part!r})")
            items.append((name.strip(), mode.strip()))
    else:
        raise ValueError("give a dict such as {'softmax': 'low'} or text such as 'softmax:low;linear:fp32'")
    known = ops.canonical_ops()
    for name, mode in items:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"{name!r} is not an op the registry knows{hint}; use canonical names such as "
                             "linear, softmax, layer_norm (graphopt.ops.canonical_ops())")
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} for {name!r} is not one of {', '.join(MODES)}")
    return ";".join(f"{name}:{mode}" for name, mode in sorted(items))


def policy_dict(text: str | None) -> dict[str, str]:
    return dict(part.split(":") for part in text.split(";") if part) if text else {}
