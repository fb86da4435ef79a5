"""Whether fusing pays: the fuse pass's one place for profit, apart from legality (fusion.py's
can_merge says what may be merged; this says what is worth a kernel).

1. A group pays when it computes at least two ops (an identity dropout computes nothing: one op
   alone is eager's kernel again, plus a launch), or when it holds a norm or softmax over rows:
   one alone saves less for the backward than eager's.
2. A linear's or convolution's bias add pays in a group only beside an op whose backward computes
   (a GELU, a norm, a dropout): an add or a cast passes its gradient through, and a cast (HF's
   logits.float()) may be no copy at all, where the group would store one. On a squeeze-excite's
   1x1 map (its values gate whole channels) it saves no memory worth the name, so there it goes
   only to an op that would be a kernel alone (EfficientNet's SiLU between the two convolutions,
   not the sigmoid that joins the product after it), and not to one whose gradient is computed by
   cases: moving the add out of the convolution's sum changes its rounding, and a ReLU that flips
   at a tie the ulp crosses moves a whole channel's gradient.
"""
from __future__ import annotations

import torch.fx

from ... import ops
from .epilogue_members import gates_channels
from .row_members import BATCH_NORMS, NORMALIZING


def group_pays(nodes: list[torch.fx.Node], members: dict) -> bool:
    """Step 1: whether the group is worth a kernel (a group that is not leaves its op alone)."""
    normalizes = any(members[n].op in NORMALIZING + BATCH_NORMS and members[n].row is not None for n in nodes)
    return normalizes or sum(not members[n].identity for n in nodes) >= 2


def bias_add_pays(node: torch.fx.Node, members: dict) -> str | None:
    """Step 2 for a bias add member (Member.epilogue): None when it is worth moving out of its
    matmul into the group after it, else why not."""
    m = members[node]
    users = [u for u in node.users if u in members and not members[u].epilogue]
    if all(_passes_gradient(members[u].op) for u in users):
        joined = ", ".join(sorted({members[u].op for u in users})) or "nothing"
        return f"its bias add would join only {joined}, which passes the gradient through: it stays in the matmul"
    if gates_channels(m.row, m.epilogue):
        for u in users:
            if _piecewise_gradient(members[u].op):
                return (f"its bias gates whole channels, and {u.name}'s gradient is computed by cases: it stays in "
                        "the convolution, whose rounding the gradient's cases follow")
            if _beside_members(u, node, members):
                return (f"its bias gates whole channels, and {u.name} would be fused without it: too little to save "
                        "to move it out of the convolution")
    return None


def _passes_gradient(op_name: str) -> bool:
    op = ops.canonical_ops().get(op_name)
    return op is not None and op.passes_gradient


def _piecewise_gradient(op_name: str) -> bool:
    op = ops.canonical_ops().get(op_name)
    return op is None or op.piecewise_gradient


def _beside_members(node: torch.fx.Node, but: torch.fx.Node, members: dict) -> bool:
    """Whether a candidate other than `but` gives the node a value or takes its value (not a
    bias add's: its matmul, outside any group, is what reads or makes it)."""
    return any(v in members and v is not but and not members[v].epilogue for v in [*node.all_input_nodes, *node.users])
