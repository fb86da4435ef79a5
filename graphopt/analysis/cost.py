"""What running a node costs, in nanoseconds: estimated from its FLOPs and bytes, or
measured (profile=True).

The estimate is a roofline with a fixed cost per op: max(FLOPs / rate, bytes moved /
bandwidth) plus what dispatching one op costs (launching one kernel on CUDA; aten's dispatch
on CPU, where a small model's elementwise ops cost little else). Matmuls, convolutions and
attention have one FLOP rate, every other op's arithmetic a lower one (a training-mode
batch norm or a 3x3 max pool is bound by its arithmetic on CPU, not by its bytes). FLOPs alone
rank a plan that reruns two hundred small elementwise ops below one that reruns two matmuls;
on the corpus's transformers the first is the slower step. A checkpointed segment adds a fixed
cost (torch.utils.checkpoint's hooks, and its RNG state where the segment draws), and a
selective one a cost per aten call (its policy runs as a dispatch mode on every call below
autograd, in the forward and again in the rerun: a batch norm that updates its statistics once
is six calls, a linear on a 3-d input four; analysis/saved.py counts them). The rates rank
plans; they do not predict time.

On CPU the rates are wall times measured on this project's 2-core machine, rounded; on CUDA the
FLOP rates and bandwidth are round figures, and the per-op, per-segment and per-call policy
costs, which are host-side Python and dispatch, are the CPU's until a GPU measures them. The
measurements behind each constant are in docs/benchmarks.md ("The cost model's constants").

node_times runs the graph's forward on the example inputs (real tensors, the model's own
parameters), timing each call node by itself; the median of a few runs. Buffers and the RNG
are restored afterwards, so profiling leaves no trace on the model (batch-norm statistics,
dropout's random stream).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.fx

from .. import ops
from .effects import CALLS
from .meta import leaves, tensor_info
from .saved import params_read
from .trial import trial_run


@dataclass(frozen=True)
class CallCost:
    """Host time of one call: its forward, and its forward and backward (a training step's share)."""

    forward_s: float
    step_s: float


@dataclass(frozen=True)
class Rates:
    flops_per_s: float         # matmuls, convolutions and attention
    vector_flops_per_s: float  # every other op's arithmetic: norms, pooling, activations
    bytes_per_s: float
    op_s: float         # dispatching one op that computes
    view_s: float       # one view or metadata op
    segment_s: float    # one checkpointed segment, forward and rerun
    policy_op_s: float  # each aten call in a selective segment, through its policy's dispatch mode
    # Host time of an eager elementwise op and of graphopt's fused calls, launches included: what
    # decides whether a group pays on a device (passes/fuse/profit.py). Measured with kernels left
    # out (`python bench/host_time.py --calls`), plus a launch per kernel on CUDA.
    eager_op: CallCost = CallCost(2.3e-6, 9e-6)
    fused: CallCost = CallCost(1.5e-5, 4e-5)         # an elementwise group (runtime/fused.py)
    fused_rows: CallCost = CallCost(1.5e-5, 6.2e-5)  # a row group (runtime/fused_row.py)
    # The optimizer's step on the host (analysis/host_step.py), measured by `python bench/host_link.py`:
    # copies between device and host memory, each way, the host's AdamW step (its fused CPU kernel,
    # on bfloat16 parameters) per byte of the parameters it updates, and a microbatch's gradient added
    # to the host's per byte (the host is the same CPU on every device until a GPU machine measures its own).
    host_bytes_per_s: float = 5e9
    host_step_bytes_per_s: float = 2.4e9
    host_add_bytes_per_s: float = 3.7e9


LAUNCH_S = 3e-6  # one CUDA kernel launch's host time, from ATen or from a bound Triton launcher
RATES = {
    "cpu": Rates(flops_per_s=1e11, vector_flops_per_s=3.4e9, bytes_per_s=1.3e10, op_s=5e-6, view_s=1.5e-6, segment_s=1.1e-4, policy_op_s=4e-5),
    # on CUDA an eager op launches a kernel forward and one backward, as a fused call does (and a
    # row call a third: its weights' partial sums added up)
    "cuda": Rates(flops_per_s=2e14, vector_flops_per_s=3e13, bytes_per_s=2.5e12, op_s=5e-6, view_s=1.5e-6,
                  segment_s=1.1e-4, policy_op_s=4e-5, host_bytes_per_s=2.5e10,
                  eager_op=CallCost(2.3e-6 + LAUNCH_S, 9e-6 + 2 * LAUNCH_S),
                  fused=CallCost(1.5e-5 + LAUNCH_S, 4e-5 + 2 * LAUNCH_S),
                  fused_rows=CallCost(1.5e-5 + LAUNCH_S, 6.2e-5 + 3 * LAUNCH_S)),
}


def rates(device: str) -> Rates:
    return RATES.get(device, RATES["cuda"])


class _Timer(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, cuda: bool):
        super().__init__(gm)
        self.cuda = cuda
        self.times: dict[str, list[float]] = {}

    def run_node(self, n: torch.fx.Node):
        if n.op not in CALLS:
            return super().run_node(n)
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = super().run_node(n)
        if self.cuda:
            torch.cuda.synchronize()
        self.times.setdefault(n.name, []).append(time.perf_counter() - start)
        return out


def node_times(gm: torch.fx.GraphModule, flat_inputs: list, repeats: int = 3) -> dict[str, float]:
    """Median seconds of each call node's forward on the example inputs (after one warm-up run)."""
    cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in flat_inputs)
    timer = _Timer(gm, cuda)
    with trial_run(gm, flat_inputs), torch.no_grad():
        for _ in range(repeats + 1):
            timer.run(*flat_inputs)
    return {name: statistics.median(t[1:]) for name, t in timer.times.items()}


def dispatches(node: torch.fx.Node, gm: torch.fx.GraphModule) -> int:
    """1 for a node that runs an op when the graph runs, 0 for one that does not (placeholders,
    attribute reads, Python arithmetic on sizes, getitem of a tuple)."""
    if node.op not in CALLS:
        return 0
    return int(tensor_info(node) is not None or getattr(node.target, "__module__", None) not in ("_operator", "builtins"))


def estimated_seconds(node: torch.fx.Node, gm: torch.fx.GraphModule, r: Rates) -> float:
    """The roofline estimate of one forward run of node (see the module's docstring)."""
    if not dispatches(node, gm):
        return 0.0
    op = ops.lookup(node, gm)
    if op is not None and op.kind == "view":
        return r.view_s
    made = [node, *(i for i in node.all_input_nodes if i.op != "get_attr")]  # attributes: params_read
    moved = sum(info.nbytes for n in made for info in leaves(tensor_info(n)))
    moved += sum(p.untyped_storage().nbytes() for p in params_read(gm, node).values())
    rate = r.flops_per_s if op is not None and op.kind == "matmul" else r.vector_flops_per_s
    return r.op_s + max(ops.flops(node, gm) / rate, moved / r.bytes_per_s)


# A training step costs about three forwards: the forward, and a backward that computes two
# products (input and weight gradients) for each of the forward's.
STEP_FORWARDS = 3


def forward_costs(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], device: str = "cpu",
                  times: dict[str, float] | None = None) -> list[int]:
    """Per node, nanoseconds of one forward run (what recomputing it costs): estimated for
    `device`, or measured (times, from node_times)."""
    if times is None:
        r = rates(device)
        return [round(estimated_seconds(n, gm, r) * 1e9) for n in nodes]
    return [round(times.get(n.name, 0.0) * 1e9) for n in nodes]


def step_costs(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], device: str = "cpu",
               times: dict[str, float] | None = None) -> list[int]:
    """Per node, nanoseconds of its forward and backward in a training step."""
    return [STEP_FORWARDS * c for c in forward_costs(gm, nodes, device, times)]
