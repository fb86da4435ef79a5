"""The records the op registry hands out: OpInfo (what an op is) and Bound (how a node calls it)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

KINDS = ("elementwise", "view", "reduction", "matmul", "normalization", "loss", "random", "creation", "other")
PRECISION_CLASSES = ("lower", "fp32", "promote")  # None: runs in whatever its inputs are (autocast's unlisted ops)
OUTPUTS = ("tensor", "tuple", "scalar", "none")


@dataclass(frozen=True)
class OpInfo:
    name: str
    kind: str
    operands: tuple[str, ...]
    params: tuple[tuple[str, object], ...] = ()
    triton: str | None = None
    derivatives: tuple[str | None, ...] | None = None
    inplace: str | None = None
    precision: str | None = None
    random: bool = False
    mutates: bool = False
    inplace_of: str | None = None  # set on an in-place twin: the op it is the in-place form of
    out_variant: str | None = None  # name of the twin that writes into an `out=` tensor
    out_variant_of: str | None = None
    side_effect: bool = False  # must survive dead-code elimination though its result is unused (asserts)
    aliases: bool = False  # the result may share storage with an input (views, and casts that are no-ops)
    keeps_order: bool = False  # a view reading its input's elements in their order, in another shape (reshape)
    output: str = "tensor"  # what the node produces: one of OUTPUTS
    blas: bool = False  # its CUDA kernel calls cuBLAS (whose handles each hold a workspace: analysis/cuda_workspaces.py)
    batch_stats: bool = False  # in training it normalizes by its batch's statistics (analysis/batch_wide.py)

    @property
    def is_check(self) -> bool:
        """An assertion: it writes nothing and may run again, but must not be dropped."""
        return self.side_effect and self.output == "none"

    @property
    def passes_gradient(self) -> bool:
        """Whether its backward reads no value, neither an operand nor its result: each gradient is
        the incoming one, scaled by params at most (add, sub, neg, a cast)."""
        known = {"g", *(name for name, _ in self.params)}
        return self.derivatives is not None and all(
            d is None or set(re.findall(r"\{(\w+)\}", d)) <= known for d in self.derivatives)

    @property
    def piecewise_gradient(self) -> bool:
        """Whether a derivative template computes by cases (a comparison, a where, a max or min:
        relu, hardswish, clamp): an operand moved by an ulp across a case's edge moves the
        gradient by a step, not by an ulp."""
        return any(re.search(r"tl\.(where|maximum|minimum)|[<>]", d or "") for d in self.derivatives or ())

    def __post_init__(self):
        assert self.kind in KINDS, (self.name, self.kind)
        assert self.precision in PRECISION_CLASSES + (None,), (self.name, self.precision)
        assert self.output in OUTPUTS, (self.name, self.output)
        assert self.derivatives is None or len(self.derivatives) == len(self.operands), self.name
        assert self.triton is None or self.kind == "elementwise", self.name


@dataclass(frozen=True)
class Bound:
    """A node's call expressed in its op's canonical terms.

    operands: one entry per `op.operands` name: an fx Node, a python scalar, a tuple of Nodes
    (cat's tensor list), a tensor owned by the called nn.Module (nn.Linear.weight), or None for an
    absent optional operand (a bias-free linear).
    params: every name of `op.params`, defaults filled in.
    """

    op: OpInfo
    operands: tuple
    params: dict = field(default_factory=dict)

    def __getitem__(self, name):
        """Operand or param by canonical name."""
        if name in self.op.operands:
            return self.operands[self.op.operands.index(name)]
        return self.params[name]
