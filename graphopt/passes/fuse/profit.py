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
3. On CUDA a group pays only if its call is faster than the eager ops it replaces at the
   example's sizes: each op, and the call, takes the longer of its host time (dispatch, autograd,
   allocations, the launch: analysis/cost.Rates, measured per device) and its memory traffic at
   the device's bandwidth, a training step's forward and backward (three times the forward's
   bytes) or an inference's forward. Small tensors are host-bound: there a fused call, one Python
   autograd function, costs what several eager ops cost, and a group of two of them stays eager;
   large ones are bound by their bytes, which the group saves. Under Triton's interpreter (the
   tests' kernels, on CPU) nothing is timed: the kernels are there to be checked.
"""
from __future__ import annotations

import torch.fx

from ... import ops
from ...analysis.cost import Rates
from ...analysis.meta import leaves, tensor_info
from ...codegen.row_group import RowGroup
from .epilogue_members import gates_channels
from .row_members import BATCH_NORMS, NORMALIZING, info_of


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


def slower_than_eager(group, rates: Rates, train: bool) -> str | None:
    """Step 3 for a FusionGroup: None when its call is faster than its eager ops on this device,
    else why it stays eager."""
    cost = (lambda c: c.step_s) if train else (lambda c: c.forward_s)
    scale = 3 if train else 1  # a backward reads and writes about twice what its forward does
    computing = [n for n in group.nodes if n not in group.aliases]
    eager = sum(max(cost(rates.eager_op), scale * _moved(n) / rates.bytes_per_s) for n in computing)
    moved = sum(info_of(v).nbytes for v in group.inputs if info_of(v) is not None)
    moved += sum(i.nbytes for n in group.outputs for i in leaves(tensor_info(n)))
    call = rates.fused_rows if isinstance(group.group, RowGroup) else rates.fused
    fused = max(cost(call), scale * moved / rates.bytes_per_s)
    if fused < eager:
        return None
    bound = "host" if cost(call) >= scale * moved / rates.bytes_per_s else "memory"
    return (f"its call would take {fused * 1e6:.1f} us ({bound}-bound) where its {len(computing)} eager ops take "
            f"{eager * 1e6:.1f} us at these sizes: left eager")


def _moved(node: torch.fx.Node) -> int:
    """Bytes one eager run of the node reads and writes."""
    read = sum(i.nbytes for v in dict.fromkeys(node.all_input_nodes) for i in leaves(tensor_info(v)))
    return read + sum(i.nbytes for i in leaves(tensor_info(node)))
