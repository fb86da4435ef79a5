"""The forward Triton kernel of a fused group.

1. Header comments name the ops, the FX nodes they came from, and each tensor's dtype and layout.
2. Scaffolding (kernel.py): flat masked index, unravel, a load per input (upcast to fp32).
3. One line per step: its registry template over fp32 values (program.py).
4. A store per output, cast to the output's torch dtype.
"""
from __future__ import annotations

from .group import Group
from .kernel import header, indent, index, load, module, kernel_signature, store
from .program import forward_lines
from .spec import Spec

KERNEL = "fused_forward"


def forward_source(group: Group, spec: Spec, dtypes) -> str:
    """dtypes: every step's dtype (the LaunchPlan's)."""
    by_name = {o.name: o for o in spec.operands}
    body = index(spec)
    body += [load(o) for o in spec.operands if o.name.startswith("x")]
    body += [f"{line.target} = {line.expr}  # {line.comment}" for line in forward_lines(group, dtypes)]
    body += [store(by_name[f"out{i}"], f"v{j}") for i, j in enumerate(group.outputs)]
    return module(header(group.describe(), group.origin, spec), kernel_signature(KERNEL, spec) + indent(body))
