"""The op registry: what every pass needs to know about an fx node's op, asked in one place.

lookup(node) names the canonical op a node calls however it is spelled (torch.relu, F.relu,
x.relu(), nn.ReLU, aten.relu.default, ...); bind(node) also matches its arguments to the op's
operands and params; flops(node) estimates its forward cost. Ops the registry does not know come
back as None: passes leave them alone.
"""
from .flops import flops
from .opinfo import KINDS, PRECISION_CLASSES, Bound, OpInfo
from .registry import canonical_ops, lookup_target, targets_of
from .resolve import bind, lookup

__all__ = ["KINDS", "PRECISION_CLASSES", "OpInfo", "Bound", "lookup", "lookup_target", "bind", "flops",
           "canonical_ops", "targets_of"]
