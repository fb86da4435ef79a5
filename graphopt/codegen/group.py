"""The fused-group IR: a straight-line program of registry elementwise ops over tensor inputs.

A Group is what the fusion pass hands to codegen. Each step applies one op of the registry
(graphopt.ops: kind "elementwise", with a Triton template) to args that are ("input", k),
("step", j) for an earlier step j, or Python scalars; outputs name the steps the group returns.

Result dtypes follow torch, so a fused group returns what eager would:
1. An input's dtype, and whether it is 0-dim (0-dim tensors promote weakly), come from its tensor.
2. to_dtype gives its `dtype` param; an op whose template is a comparison gives bool; any other op
   gives torch's default elementwise promotion of its operands, Python scalars weak.
3. Refused (Unsupported, with the reason): float64 and complex anywhere, since the templates compute
   in fp32; integer values consumed by anything but a cast, since torch's integer rules are op-specific
   (div gives float, // floors exactly) and fp32 holds integers exactly only below 2**24; arithmetic
   whose promoted result is bool or integer, for the same reason.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from ..ops import canonical_ops
from ..ops.shim import evaluate
from ..vocabulary.precisions import torch_name

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
SCALARS = (bool, int, float)


class Unsupported(ValueError):
    """A group (or a group at these dtypes) that codegen declines; the message says why."""


@dataclass(frozen=True)
class Input:
    name: str = ""  # for comments in the generated source only


@dataclass(frozen=True)
class Step:
    op: str
    args: tuple  # one per operand of the op: ("input", k), ("step", j) or a Python scalar
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "args", tuple(tuple(a) if isinstance(a, list) else a for a in self.args))
        object.__setattr__(self, "params", dict(self.params))


@dataclass(frozen=True)
class Group:
    inputs: tuple
    steps: tuple
    outputs: tuple  # step indices; a step may be listed once
    origin: tuple = ()  # what the group came from (FX node names), written as comments into the kernels

    def __post_init__(self):
        for name in ("inputs", "steps", "outputs", "origin"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "inputs", tuple(i if isinstance(i, Input) else Input(str(i)) for i in self.inputs))
        object.__setattr__(self, "steps", tuple(checked_step(j, s, len(self.inputs)) for j, s in enumerate(self.steps)))
        if not self.outputs:
            raise ValueError("a fused group needs at least one output step")
        for j in self.outputs:
            if not (isinstance(j, int) and 0 <= j < len(self.steps)):
                raise ValueError(f"output {j!r} is not a step index (the group has {len(self.steps)} steps)")
        if len(set(self.outputs)) != len(self.outputs):
            raise ValueError(f"outputs {list(self.outputs)} list a step twice; return it once and reuse the result")

    def structure(self) -> tuple:
        """Everything the generated code depends on but the tensors: ops, wiring, params, outputs.
        Scalars are keyed by type and repr: 1, 1.0 and True promote differently; -0.0 and nan are values."""
        def key(v):
            return (type(v).__name__, repr(v))
        steps = tuple((s.op, tuple(a if is_ref(a) else key(a) for a in s.args),
                       tuple(sorted((k, key(v)) for k, v in s.params.items()))) for s in self.steps)
        return len(self.inputs), steps, self.outputs

    def describe(self) -> str:
        return " -> ".join(s.op for s in self.steps)


def is_ref(arg) -> bool:
    return isinstance(arg, tuple) and len(arg) == 2 and arg[0] in ("input", "step")


def op_info(name: str):
    """The registry's OpInfo for a fusable op, or ValueError saying what to do instead."""
    op = canonical_ops().get(name)
    if op is None:
        raise ValueError(f"unknown op {name!r}: a step names a canonical op of graphopt.ops (canonical_ops())")
    if op.inplace_of or op.out_variant_of:
        raise ValueError(f"{name} writes into a tensor; fuse its out-of-place form {op.inplace_of or op.out_variant_of}")
    if op.kind != "elementwise":
        raise ValueError(f"{name} is a {op.kind} op; only elementwise ops are fused")
    if op.triton is None:
        raise ValueError(f"{name} has no Triton template in the registry (integer bit operations have no fp32 form); "
                         "leave it out of the group")
    return op


def checked_step(j: int, step, n_inputs: int) -> Step:
    if not isinstance(step, Step):
        step = Step(*step)
    op = op_info(step.op)
    if len(step.args) != len(op.operands):
        raise ValueError(f"step {j} ({step.op}) has {len(step.args)} args; {step.op} takes {len(op.operands)}: "
                         f"{', '.join(op.operands)}")
    for a in step.args:
        if is_ref(a):
            kind, k = a
            limit = n_inputs if kind == "input" else j
            if not (isinstance(k, int) and 0 <= k < limit):
                raise ValueError(f"step {j} ({step.op}) refers to {a}, which is not an {kind} before it")
            continue
        if not isinstance(a, SCALARS):
            raise ValueError(  # noqa: TRY004 (a malformed group, as every check here)
                f"step {j} ({step.op}) has arg {a!r}: an arg is ('input', k), ('step', j) or a Python number; "
                "make tensors group inputs")
    if not any(is_ref(a) for a in step.args):
        raise ValueError(f"step {j} ({step.op}) has only scalar args; fold it into a constant")
    defaults = dict(op.params)
    unknown = step.params.keys() - defaults.keys()
    if unknown:
        raise ValueError(f"step {j} ({step.op}) has unknown params {sorted(unknown)}; {step.op} takes "
                         f"{sorted(defaults) or 'none'}")
    params = {**defaults, **step.params}
    missing = [p for p, v in params.items() if v is None]
    if missing:
        raise ValueError(f"step {j} ({step.op}) needs params {missing}")
    bad = [p for p, v in params.items() if not isinstance(v, SCALARS + (torch.dtype,))]
    if bad:
        raise ValueError(f"step {j} ({step.op}) params {bad} are not Python numbers (nor to_dtype's dtype)")
    return Step(step.op, step.args, params)


@cache
def is_comparison(name: str) -> bool:
    """Whether the op's template yields bool, found by evaluating it: the registry states no result dtype."""
    op = canonical_ops()[name]
    params = {p: 1.0 if v is None else v for p, v in op.params}
    return torch.as_tensor(evaluate(op.triton, **{o: torch.ones(2) for o in op.operands}, **params)).dtype == torch.bool


@dataclass(frozen=True)
class Value:
    """What dtype promotion needs to know of a tensor: its dtype, and whether it is 0-dim."""
    dtype: torch.dtype
    zero_dim: bool = False

    def meta(self) -> torch.Tensor:
        return torch.empty(() if self.zero_dim else (1,), dtype=self.dtype, device="meta")


def as_value(t) -> Value:
    if isinstance(t, Value):
        return t
    if isinstance(t, torch.dtype):
        return Value(t)
    return Value(t.dtype, t.dim() == 0)


def step_dtypes(group: Group, inputs: Sequence) -> list[torch.dtype]:
    """The dtype of every step (see the module docstring); inputs are tensors, Values or dtypes.
    Raises Unsupported with the reason for a group codegen declines at these dtypes."""
    if len(inputs) != len(group.inputs):
        raise ValueError(f"the group has {len(group.inputs)} inputs, got {len(inputs)}")
    inputs = [as_value(t) for t in inputs]
    for k, v in enumerate(inputs):
        if v.dtype not in FLOATS + INTEGERS + (torch.bool,):
            raise Unsupported(f"input {k} is {torch_name(v.dtype)}: the templates compute in fp32, so only float32, float16, "
                              "bfloat16, bool and integer (cast) inputs are fused")
    values: list[Value] = []
    for j, step in enumerate(group.steps):
        refs = [inputs[a[1]] if a[0] == "input" else values[a[1]] for a in step.args if is_ref(a)]
        zero_dim = all(v.zero_dim for v in refs)
        if step.op == "to_dtype":
            dtype = step.params["dtype"]
            if dtype not in FLOATS + INTEGERS + (torch.bool,):
                raise Unsupported(f"step {j} casts to {torch_name(dtype)}; the templates compute in fp32")
            values.append(Value(dtype, zero_dim))
            continue
        ints = [torch_name(v.dtype) for v in refs if v.dtype in INTEGERS]
        if ints:
            raise Unsupported(f"step {j} ({step.op}) computes on {ints[0]} values: only casts of integer tensors are "
                              "fused (fp32 templates are exact for integers only below 2**24, and torch's integer "
                              "// and % floor exactly)")
        if is_comparison(step.op):
            values.append(Value(torch.bool, zero_dim))
            continue
        operands = [v.meta() if is_ref(a) else a
                    for a, v in zip(step.args, _refs_or_none(step.args, inputs, values))]
        _, dtype = elementwise_dtypes(*operands, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
        if dtype not in FLOATS:
            raise Unsupported(f"step {j} ({step.op}) computes in {torch_name(dtype)}: arithmetic on bool or integer "
                              "values is not fused (torch's rules for it are op-specific)")
        values.append(Value(dtype, zero_dim))
    return [v.dtype for v in values]


def _refs_or_none(args, inputs, values):
    return [(inputs[a[1]] if a[0] == "input" else values[a[1]]) if is_ref(a) else None for a in args]


def step_shapes(group: Group, shapes: Sequence) -> list[torch.Size]:
    """Each step's eager (broadcast) shape, from the inputs' shapes."""
    out: list[torch.Size] = []
    for step in group.steps:
        refs = [shapes[a[1]] if a[0] == "input" else out[a[1]] for a in step.args if is_ref(a)]
        out.append(torch.broadcast_shapes(*refs))
    return out


def supports(group: Group, inputs: Sequence | None = None) -> str | None:
    """None when codegen handles `group` (at the inputs' dtypes, when given), else the reason it does not."""
    try:
        if not isinstance(group, Group):
            group = Group(*group)
        if inputs is not None:
            step_dtypes(group, inputs)
    except ValueError as e:
        return str(e)
    return None


def differentiable(dtype: torch.dtype) -> bool:
    return dtype in FLOATS
