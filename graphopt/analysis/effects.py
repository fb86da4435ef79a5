"""Which nodes change state beyond their result, from the registry alone (an analysis).

Opaque calls may have side effects; mutating ops write state; a module with buffers updates
them in training (BatchNorm's running statistics). Such a node must run exactly once:
cleanups may not merge or remove it, and recompute may not run it again. An assertion
(`torch._assert`) writes nothing: it may run again, only dead-code elimination keeps it.
Random ops change no state but draw from the RNG: cleanups keep them (dropout masks would
change), recompute may run them again (torch.utils.checkpoint replays the RNG state).
"""
from __future__ import annotations

import torch.fx
from torch.fx.operator_schemas import normalize_function

from .. import ops
from .aliases import Aliases
from .dispatched import dispatched
from .meta import TensorInfo, tensor_info

CALLS = ("call_function", "call_method", "call_module")


def state_effect(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str | None:
    """Why running the call node changes state beyond its result; None when it does not. A call
    the registry does not list is judged by the operators it dispatched (dispatched.py)."""
    op = ops.lookup(node, gm)
    if op is None:
        facts = dispatched(node)
        if facts is None:
            return "opaque op (the registry does not know it, and no annotation ran it): it may have side effects"
        if facts.unread:
            return f"opaque call: it reaches {facts.unread}, whose effects no schema says"
        if facts.writes:
            return f"opaque call: it dispatches {facts.writes}"
        return f"opaque call: it dispatches {facts.draws}, which draws random numbers" if facts.draws else None
    if op.is_check:
        return None
    if op.mutates or op.side_effect:
        return f"{op.name} writes state"
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if module.training and any(True for _ in module.buffers()):
            return f"{type(module).__name__} updates its buffers in training"
    return None


def declared_functional(node: torch.fx.Node) -> bool:
    """Whether a call the registry does not know declares in its schema that it only computes its
    result: an operator overload (aten's, or a library's from torch.library.custom_op, whose
    `mutates_args` torch requires exact) that writes no argument, returns tensors aliasing none,
    draws nothing (no nondeterministic_seeded tag) and is not one of torch.fx's side-effectful
    calls: the contract torch.fx's own dead-code elimination trusts (Node.is_impure)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or node.is_impure():
        return False
    schema = target._schema
    returns = schema.returns
    return (bool(returns) and all(r.alias_info is None and str(r.type) in ("Tensor", "Tensor[]") for r in returns)
            and not any(a.alias_info is not None for a in schema.arguments)
            and torch.Tag.nondeterministic_seeded not in target.tags)


def function_writes(node: torch.fx.Node) -> str | None:
    """For a call of a model's own autograd.Function (custom_functions.FunctionCall): why its
    forward is not known to leave its inputs as they were (it wrote one, on FakeTensors like
    them, or its inputs are not annotated); None when it wrote none. What else it may touch
    (a global, a captured buffer) no graph shows: the model's own checkpointing reruns it too.
    Run once per node (kept in its meta, which a segment's copy of it shares)."""
    if "graphopt_function_writes" not in node.meta:
        try:
            node.meta["graphopt_function_writes"] = _function_writes(node)
        except TypeError as e:  # asked before annotation: no answer to keep
            return f"an input of {node.name} is not annotated ({e})"
    return node.meta["graphopt_function_writes"]


def _function_writes(node: torch.fx.Node) -> str | None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake(value, mode):
        value = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
        if isinstance(value, torch.Tensor):
            return mode.from_tensor(value)
        if value is None or isinstance(value, (int, float, bool, str, torch.dtype, torch.device)):
            return value
        raise TypeError(type(value).__name__)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), lambda v: fake(v, mode))
    inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    versions = [t._version for t in inputs]
    try:
        with mode, torch.no_grad():
            node.target(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (any failure leaves the question open)
        return f"its forward could not run on FakeTensors ({type(e).__name__})"
    if any(t._version != v for t, v in zip(inputs, versions)):
        return f"{node.target!r} writes one of its inputs in place"
    return None


def pure_op(node: torch.fx.Node, gm: torch.fx.GraphModule):
    """The node's OpInfo when it is a pure, deterministic op; None otherwise."""
    if node.op not in CALLS or state_effect(node, gm) is not None:
        return None
    op = ops.lookup(node, gm)
    return None if op is None or op.random else op


def may_draw(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """Whether the call node may draw from the RNG: a random op, or one the registry does not know."""
    if node.op not in CALLS or reads_attribute(node):
        return False
    op = ops.lookup(node, gm)
    if op is None:  # by what it dispatched; without that record any unknown call may, but Python arithmetic on sizes
        facts = dispatched(node)
        return facts.draws is not None or facts.unread is not None if facts is not None else not size_arithmetic(node)
    return op.random


def is_identity_dropout(op, params: dict) -> bool:
    """Whether a random op with these bound params is a dropout that draws nothing and returns
    its input (ATen's dropout for p=0 or train=False returns the input tensor itself). A random
    op with a `train` switch is a dropout: the registry says so by its params."""
    return "train" in params and len(op.operands) == 1 and op.output == "tensor" and (
        params["train"] is False or params.get("p") == 0)


def is_impure(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "get_attr":
        return False
    op = pure_op(node, gm)
    if op is not None and op.is_check:  # torch.fx calls every assertion impure
        return not settled_check(node, gm)
    return op is None or node.is_impure()


def settled_check(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """Whether the check node is a metadata assertion that holds on every call the module takes,
    so that dead-code elimination may drop it with what it alone reads.

    torch.export writes `aten._assert_tensor_metadata` before each `.to()`, also on tensors the
    graph computes from its inputs alone: a causal mask built from `cumsum` and `index` stays
    alive for them only after the mask goes from attention. An export graph's
    every call passes a guard on its inputs' dtypes and devices first (api.py installs one), so
    the dtype of a tensor computed from those inputs alone, through known ops, is the traced
    one. Not for floating results (autocast, around the call, changes those), nor for tensors
    that read a parameter or buffer (`model.half()` changes those), nor for size or stride
    checks (a dynamic batch changes sizes)."""
    asserted = asserted_metadata(node, gm) if gm.meta.get("graphopt_frontend") == "export" else None
    if asserted is None:
        return False
    checked = asserted.get("a")
    info = tensor_info(checked) if isinstance(checked, torch.fx.Node) else None
    if (not isinstance(info, TensorInfo) or info.dtype.is_floating_point or info.dtype.is_complex
            or asserted.get("size") is not None or asserted.get("stride") is not None
            or asserted.get("dtype") not in (None, info.dtype) or asserted.get("device") not in (None, info.device)
            or asserted.get("layout") not in (None, torch.strided)):
        return False
    seen, todo = set(), [checked]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr" or (n.op in CALLS and ops.lookup(n, gm) is None and not size_arithmetic(n)):
            return False
        todo.extend(n.all_input_nodes)
    return True


def asserted_metadata(node: torch.fx.Node, gm: torch.fx.GraphModule | None) -> dict | None:
    """What an `aten._assert_tensor_metadata` node asserts, by name (a, size, stride, dtype, device,
    layout); None for any other node."""
    op = ops.lookup(node, gm)
    if op is None or op.name != "assert_tensor_metadata":
        return None
    bound = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    return bound.kwargs if bound is not None else {}


def kind_check(node: torch.fx.Node, gm: torch.fx.GraphModule | None) -> bool:
    """Whether the node asserts a tensor's dtype, device or layout alone (no size, no stride) and
    nothing reads it: what a fused group's own check of its inputs' dtypes and devices, when a
    call binds, settles for every value the group computes (passes/fuse absorbs such checks)."""
    asserted = asserted_metadata(node, gm)
    return (asserted is not None and not node.users and asserted.get("size") is None
            and asserted.get("stride") is None and asserted.get("layout") in (None, torch.strided))


def size_arithmetic(node: torch.fx.Node) -> bool:
    """Python arithmetic on sizes and attributes (x.shape[1], c // heads): no tensor made, no
    state written, nothing drawn; it may run any number of times."""
    return tensor_info(node) is None and (node.target is getattr or getattr(node.target, "__module__", None) == "_operator")


def reads_attribute(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is getattr  # x.shape, x.dtype: metadata only


def may_write(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """Whether the node may write a tensor: a mutating op, or an opaque call that is given one."""
    if node.op not in CALLS or reads_attribute(node):
        return False
    op = ops.lookup(node, gm)
    if op is not None:
        return op.mutates
    facts = dispatched(node)
    if facts is not None:
        return facts.writes is not None or facts.unread is not None
    return any(tensor_info(v) is not None for v in node.all_input_nodes)  # Python arithmetic on sizes: no


# a batch norm in training writes its running statistics (operands 3 and 4), not what it normalizes
RUNNING_STATISTICS = {"batch_norm_train": (3, 4), "native_batch_norm_train": (3, 4)}


def written_inputs(node: torch.fx.Node, gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph values a node that may write memory may write: a batch norm in training its
    running statistics (an nn.BatchNorm module's are its own buffers, no graph value); any other,
    every value it is given."""
    op = ops.lookup(node, gm)
    if op is not None and op.name in RUNNING_STATISTICS:
        bound = ops.bind(node, gm)
        if bound is not None:
            return [v for k in RUNNING_STATISTICS[op.name] if k < len(bound.operands)
                    for v in [bound.operands[k]] if isinstance(v, torch.fx.Node)]
    return list(node.all_input_nodes)


def written_values(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """Values whose storage a node that may write memory gets, with that node's name: the values it
    may write (written_inputs), and every value sharing their storage (a view of them, what they
    are a view of)."""
    aliases = Aliases(gm)
    written = {}
    for node in gm.graph.nodes:
        if may_write(node, gm):
            for value in written_inputs(node, gm):
                for m in [value, *aliases.sharing(value)]:
                    written.setdefault(m, node.name)
    return written
