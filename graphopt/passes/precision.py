"""precision: torch.autocast as a graph rewrite, with the casts written into the graph.

Options: dtype (bf16 or fp16, the low precision) and policy (per-op overrides, e.g.
{"softmax": "low", "linear": "fp32"} or the text "softmax:low;linear:fp32").

Algorithm:
  1. Give every call node its mode (autocast_plan.op_mode): the op's autocast class from the
     registry, as autocast on the graph's device applies it (CPU autocast lists fewer ops than
     CUDA's), unless the policy names the op. A call the registry does not know (an opaque
     function or leaf module) runs under torch.autocast itself (runtime/autocast.py): what
     it holds, only autocast knows how to cast.
  2. A module whose own parameters its mode would cast (nn.Linear, nn.Conv2d in low precision)
     becomes a call of the op's torch function on get_attr parameters, checked on
     FakeTensors; one that cannot be rewritten keeps its inputs' original dtypes, as does
     any node that rejects its planned dtypes on FakeTensors (step 3).
  3. AutocastPlan on FakeTensors (autocast_plan.plan): which inputs of each node are cast to which
     dtype, and every node's dtype afterwards.
  4. Insert the casts, each before the first node that needs it, one per (source, dtype):
     a parameter's source is the Parameter itself, so each is cast once per forward and its
     gradient comes back in float32 through the cast; a source is traced back through casts
     that lose nothing, so back-to-back casts fold; a source that already has the dtype is
     used as it is. Casts the user wrote stay; outputs keep the dtype their op produced.
     Assertions the trace recorded about a tensor's dtype are restated for its new dtype;
     numbers the trace took from finfo of a node's old dtype become finfo of its new one
     (AutocastPlan.constants: a masked_fill's float32 minimum overflows bf16); calls in
     autocast mode become calls under torch.autocast.
  5. Mark each node's dtype in the dumps, invalidate the metadata of nodes whose dtype
     changed, tell the verifier the compute dtype, and report casts, ops per dtype and the
     activation bytes before and after.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx
import torch.utils._pytree as pytree

from .. import ops
from ..analysis.autocast_plan import ELIGIBLE, MODES, op_mode, parse_policy, plan, policy_dict
from ..analysis.meta import TensorInfo, graph_device, invalidate, leaves, tensor_info
from ..errors import OptionError
from ..runtime.autocast import under_autocast
from ..vocabulary.precisions import LOW, low_precision, short
from .base import Pass, PassContext, PassResult, option
from .normalize import _canonical_callable
from .notes import note
from .options import OptimizeOptions
from .registry import register

CAST = "cast"  # the note on casts this pass inserted


def _fetch(gm: torch.fx.GraphModule, target: str):
    return functools.reduce(getattr, target.split("."), gm)


def _floating_dtype(info):
    first = info[0] if isinstance(info, tuple) and info else info
    return first.dtype if isinstance(first, TensorInfo) and first.dtype.is_floating_point else None


# Step 2
def _module_as_function(gm: torch.fx.GraphModule, node: torch.fx.Node, want: torch.dtype) -> str | None:
    """Rewrite a module call into its torch function when its own tensors would need a cast.

    Returns None when rewritten or nothing to do, else why the module keeps its dtypes."""
    bound = ops.bind(node, gm)
    module = gm.get_submodule(node.target)
    owned = [v for v in bound.operands if isinstance(v, torch.Tensor)] if bound else list(module.parameters())
    if not any(t.dtype in ELIGIBLE and t.dtype != want for t in owned):
        return None
    if bound is None:
        return f"the registry cannot match this {type(module).__name__}'s settings to its op's arguments"
    fn = _canonical_callable(bound.op)
    if fn is None:
        return f"{type(module).__name__} has no torch function to call with cast parameters"
    names = {id(t): name for name, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))}
    if any(id(t) not in names for t in owned):
        return f"{type(module).__name__} computes its weight in forward"
    expected = node.meta.get("val")
    if not isinstance(expected, torch.Tensor) or not hasattr(expected, "fake_mode"):
        return "no FakeTensor metadata to check the rewrite on"
    def fake(v):
        if isinstance(v, torch.Tensor):
            return expected.fake_mode.from_tensor(v)
        return v.meta.get("val") if isinstance(v, torch.fx.Node) else v

    try:
        with expected.fake_mode:
            got = fn(*(fake(v) for v in bound.operands), **bound.params)
    except Exception as e:
        return f"{fn.__name__} does not take the module's arguments ({type(e).__name__})"
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        return f"{fn.__name__} does not compute what {type(module).__name__} does"
    with gm.graph.inserting_before(node):
        operands = tuple(gm.graph.get_attr(f"{node.target}.{names[id(v)]}") if isinstance(v, torch.Tensor) else v
                         for v in bound.operands)
    node.op, node.target, node.args, node.kwargs = "call_function", fn, operands, dict(bound.params)
    return None


def _restate_assertion(gm: torch.fx.GraphModule, node: torch.fx.Node, dtypes: dict) -> bool:
    """An assertion of a tensor's dtype (export records one before each .to()) now names the
    dtype the pass gives the tensor: the pass changes it on purpose."""
    bound = ops.bind(node, gm)
    if bound is None or bound.params.get("dtype") is None or not isinstance(bound.operands[0], torch.fx.Node):
        return False
    new = dtypes.get(bound.operands[0])
    if new is None or new == bound.params["dtype"]:
        return False
    if "dtype" in node.kwargs:
        node.update_kwarg("dtype", new)
    else:
        node.update_arg([a.name for a in node.target._schema.arguments].index("dtype"), new)
    return True


class _Casts:
    """Step 4: one cast node per (source, dtype), folded through lossless casts."""

    def __init__(self, gm: torch.fx.GraphModule, dtypes: dict):
        self.gm, self.dtypes = gm, dtypes
        self.nodes: dict[tuple, torch.fx.Node] = {}
        self.aten = any(isinstance(n.target, torch._ops.OpOverload) for n in gm.graph.nodes)
        self.counts = {"params": 0, "activations": 0, "reused": 0, "folded": 0}

    def _source(self, node: torch.fx.Node) -> torch.fx.Node:
        """The value `node` casts, when the cast loses nothing (its dtype holds the source exactly)."""
        op = ops.lookup(node, self.gm)
        if op is None or op.name != "to_dtype":
            return node
        bound = ops.bind(node, self.gm)
        src = bound.operands[0] if bound else None
        if not isinstance(src, torch.fx.Node) or src not in self.dtypes or node not in self.dtypes:
            return node
        a, b = self.dtypes[src], self.dtypes[node]
        if a is None or b is None or torch.promote_types(a, b) != b:
            return node
        return self._source(src)

    def get(self, value: torch.fx.Node, dtype: torch.dtype, before: torch.fx.Node) -> torch.fx.Node:
        source = self._source(value)
        if source is not value:
            self.counts["folded"] += 1
        if self.dtypes.get(source) == dtype:
            return source
        param = source.op == "get_attr"
        key = (("tensor", id(_fetch(self.gm, source.target))) if param else source, dtype)
        if key in self.nodes:
            self.counts["reused"] += 1
            return self.nodes[key]
        graph = self.gm.graph
        with graph.inserting_before(before):
            name = f"{source.name}_{short(dtype)}"
            if self.aten:
                cast = graph.create_node("call_function", torch.ops.aten._to_copy.default, (source,), {"dtype": dtype}, name=name)
            else:
                cast = graph.create_node("call_method", "to", (source, dtype), {}, name=name)
        note(cast, "precision", f"{CAST} {short(dtype)}")
        self.nodes[key] = cast
        self.counts["params" if param else "activations"] += 1
        return cast


@dataclass(frozen=True)
class PrecisionOptions:
    """The precision pass's options."""

    precision: str | None = option(None, low_precision, "the low precision: bf16 or fp16")
    precision_policy: str | None = option(None, parse_policy,
                                f"per-op mode overrides, op:mode;op:mode with modes {', '.join(MODES)}")


@register
class Precision(Pass):
    """Compute in bf16 or fp16 where torch.autocast would, in float32 where it would."""

    name = "precision"
    Options = PrecisionOptions

    @classmethod
    def from_options(cls, options: OptimizeOptions) -> "Precision":
        """The pass optimize()'s options ask for with precision (bf16 or fp16)."""
        return cls.with_settings(PrecisionOptions(precision=options.precision,
                                                  precision_policy=options.precision_policy))

    def check_settings(self) -> None:
        if self.settings.precision is None:
            raise OptionError("pass 'precision' needs precision=bf16 or precision=fp16 (the low precision to "
                              "compute in).")

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        low = LOW[self.settings.precision]
        policy = policy_dict(self.settings.precision_policy)
        device = graph_device(gm)
        calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
        # Step 1
        modes = {n: op_mode(n, gm, device, policy) for n in calls}
        # Step 2
        declined, as_functions = {}, 0
        for node in calls:
            if node.op == "call_module" and modes[node] in ("low", "fp32"):
                target = node.target
                why = _module_as_function(gm, node, low if modes[node] == "low" else torch.float32)
                if why is not None:
                    declined[node.name], modes[node] = why, "original"
                as_functions += node.target != target
        before = {n: tensor_info(n) for n in gm.graph.nodes}
        # Step 3
        p = plan(gm, ctx.flat_inputs(gm), low, modes, device)
        declined.update(p.declined)
        dtypes = {n: _floating_dtype(info) for n, info in p.infos.items()}
        # Step 4
        casts = _Casts(gm, dtypes)
        for node, wanted in p.casts.items():
            for value, dtype in wanted.items():
                node.replace_input_with(value, casts.get(value, dtype, node))
        restated = sum(_restate_assertion(gm, n, dtypes) for n, m in p.modes.items() if m == "check")
        for node, constants in p.constants.items():
            node.args, node.kwargs = pytree.tree_map_only(float, lambda v: constants.get(v, v), (node.args, node.kwargs))
        autocast = [n for n, m in p.modes.items() if m == "autocast"]
        for node in autocast:
            under_autocast(node, gm, device, low)
        # Step 5
        by_dtype: dict[str, int] = {}
        for node in calls:
            dtype = dtypes.get(node)
            if dtype is not None:
                note(node, "precision", short(dtype))
                by_dtype[short(dtype)] = by_dtype.get(short(dtype), 0) + 1
            if dtype != _floating_dtype(before.get(node)):
                invalidate(node)
        inserted = casts.counts["params"] + casts.counts["activations"]
        act_before, act_after = _activation_bytes(gm, calls, before, p.infos, casts.nodes)
        stats = {
            "dtype": short(low), "autocast_device": device, "casts_inserted": inserted,
            "param_casts": casts.counts["params"], "activation_casts": casts.counts["activations"],
            "casts_reused": casts.counts["reused"], "casts_folded": casts.counts["folded"],
            "modules_as_functions": as_functions, "under_autocast": [n.name for n in autocast],
            "assertions_restated": restated, "constants_of_the_new_dtype": len(p.constants),
            "ops_by_dtype": by_dtype, "modes": dict(Counter(p.modes.values())),
            "activation_bytes_before": act_before, "activation_bytes_after": act_after,
            "bytes_saved": act_before - act_after, "declined": declined,
        }
        if policy:
            stats["policy"] = self.settings.precision_policy
        changed = inserted or as_functions or restated or autocast or p.constants
        return PassResult(gm, bool(changed), stats, compute_dtype=low)


def _nbytes(info) -> int:
    return sum(i.nbytes for i in leaves(info))


def _activation_bytes(gm, calls, before: dict, after: dict, casts: dict) -> tuple[int, int]:
    """Bytes of the tensors the forward makes (views excluded), before and after the pass."""
    made = [n for n in calls if (op := ops.lookup(n, gm)) is None or op.kind != "view"]
    total_before = sum(_nbytes(before.get(n)) for n in made)
    total_after = sum(_nbytes(after.get(n)) for n in made)
    for (_, dtype), cast in casts.items():
        info = after.get(cast.args[0])
        if isinstance(info, TensorInfo):
            total_after += info.nbytes // info.dtype.itemsize * dtype.itemsize
    return total_before, total_after
