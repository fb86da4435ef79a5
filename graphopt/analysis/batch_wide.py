"""What in a graph depends on the batch as a whole (an analysis: it reads the graph, never
mutates). Run in microbatches, these give another result than the full batch does; every path
that runs a batch in pieces (train_step, a staged graph called with the full batch) asks here and
says so before the numbers change.

1. BatchNorm in training normalizes by the statistics of the rows it is given and updates its
   running statistics once per call: k microbatches are k updates with momentum, each of a
   microbatch's statistics.
2. A random op (dropout in training, drop-path's bernoulli, a label dropout's rand), or a call
   graphopt does not know that makes a tensor (it may draw: torchvision's stochastic_depth),
   draws as the RNG stands when it runs: microbatch after microbatch, not the full batch's.
3. The loss's reduction over the batch: each scalar the graph returns, read back through casts and
   scalings to the op that reduces it:
   - "mean": a mean over its elements (a loss's `reduction="mean"` without ignored targets,
     `.mean()`): over equal microbatches the full batch's is the mean of theirs;
   - "sum": the full batch's is the sum of theirs;
   - "counted mean": cross-entropy's (or nll's) mean over the targets it does not ignore
     (ignore_index, transformers' -100 labels): microbatches with different counts weigh
     differently, so the full batch's is their mean weighted by each one's count, which
     `counted_targets` computes from a microbatch's inputs;
   - "unknown": no reduction found (a mean weighted by class weights among them).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from .. import ops
from .effects import CALLS, is_identity_dropout, may_draw
from .memory import output_tensors
from .meta import TensorInfo, tensor_info

COUNTED = ("cross_entropy", "nll_loss")  # their mean divides by the targets not ignored
# ATen's loss ops (as torch.export records them) take the reduction as an int
ATEN_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
# ops a loss passes through on its way out, unchanged in how it reduces over the batch
PASSING = ("to_dtype", "type_as", "clone", "contiguous", "view", "reshape", "squeeze", "alias", "detach_copy",
           "mul", "div", "neg", "float", "to")


@dataclass(frozen=True)
class LossReduction:
    node: str  # the scalar output
    kind: str  # "mean", "sum", "counted mean" or "unknown"
    how: str  # the op that reduces it, for the messages
    target: str | None = None  # a counted mean's: the target node, and the index it ignores
    ignore_index: int | None = None
    # a counted mean's: the graph's inputs -> how many targets it counts (counted_targets)
    count: torch.fx.GraphModule | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class BatchWide:
    batch_norms: tuple[str, ...]  # where a BatchNorm normalizes in training: module paths, else node names
    draws: tuple[str, ...]  # where a random op draws
    losses: tuple[LossReduction, ...]

    @property
    def whole(self) -> bool:
        """Whether microbatches give the full batch's result: nothing here depends on the batch as a
        whole, and the one loss combines exactly (a mean over rows, a sum, counted targets counted)."""
        if self.batch_norms or self.draws:
            return False
        if all(r.kind == "mean" for r in self.losses):  # each scalar combines by 1/k, exactly
            return True
        return len(self.losses) == 1 and (self.losses[0].kind == "sum" or self.losses[0].count is not None)

    def to_dict(self) -> dict:
        return {"batch_norms": list(self.batch_norms), "draws": list(self.draws),
                "losses": [{"node": r.node, "kind": r.kind, "how": r.how} for r in self.losses]}

    def notes(self, microbatches: int) -> list[str]:
        """One sentence for each batch-wide thing, for a batch run as `microbatches` pieces."""
        k, out = microbatches, []
        if self.batch_norms:
            out.append(f"BatchNorm in training ({_names(self.batch_norms)}) normalizes each of the {k} microbatches "
                       "by its own statistics "
                       f"and updates its running statistics {k} times (momentum applied per microbatch): "
                       "gradients and statistics differ from the full batch's (GroupNorm or LayerNorm do not "
                       "depend on the batch; microbatches=1 keeps it whole)")
        if self.draws:
            out.append(f"ops that draw from the RNG ({_names(self.draws)}) draw microbatch after microbatch: the draws are not "
                       "the full batch's (train_step and the staged graph draw alike for the same microbatches)")
        if len(self.losses) > 1 and any(r.kind != "mean" for r in self.losses):
            out.append(f"the graph returns {len(self.losses)} scalars ({', '.join(r.node for r in self.losses)}) and "
                       "graphopt does not know which is the loss: each combines over the microbatches as a mean")
            return out
        for loss in self.losses:
            if loss.kind == "unknown":
                out.append(f"the loss {loss.node} reduces over the batch in a way graphopt does not read "
                           f"({loss.how}): the microbatches' losses are combined as a mean")
            elif loss.kind == "sum":
                out.append(f"the loss {loss.node} sums over the batch ({loss.how}): the microbatches' losses are "
                           "added, as the full batch's")
            elif loss.kind == "counted mean" and loss.count is not None:
                out.append(f"the loss {loss.node} is a mean over the targets not equal to {loss.ignore_index} "
                           f"({loss.how}): each microbatch's loss is weighted by its count of them, so the step's "
                           "is the full batch's mean")
            elif loss.kind == "counted mean":
                out.append(f"the loss {loss.node} is {loss.how}, a mean over the targets not equal to "
                           f"{loss.ignore_index}, which graphopt does not count here: the microbatches' "
                           "losses are combined as a mean, which is the full batch's only where each microbatch "
                           "has as many counted targets")
        return out


def batch_wide(gm: torch.fx.GraphModule) -> BatchWide:
    """What of gm depends on the batch as a whole (the module docstring)."""
    norms, draws = [], []
    for node in gm.graph.nodes:
        if node.op not in CALLS:
            continue
        op, bound = ops.lookup(node, gm), ops.bind(node, gm)
        if op is not None and op.batch_stats and bound is not None and bound.params.get("training", True):
            norms.append(_where(node))
        elif may_draw(node, gm) and not (op is not None and bound is not None and is_identity_dropout(op, bound.params)) \
                and (op is not None or isinstance(tensor_info(node), TensorInfo)):
            # a call graphopt does not know that makes a tensor may draw (torchvision's stochastic_depth);
            # one that builds the output's container does not
            draws.append(_where(node))
    rows = graph_batch_rows(gm)
    losses = [loss_reduction(gm, n, rows) for n in output_tensors(gm)
              if isinstance(i := tensor_info(n), TensorInfo) and i.shape == () and i.dtype.is_floating_point]
    losses = tuple(dataclasses.replace(r, count=counted_targets(gm, r)) if r.kind == "counted mean" else r
                   for r in losses)
    return BatchWide(tuple(dict.fromkeys(norms)), tuple(dict.fromkeys(draws)), losses)


def traced_loss(wide: BatchWide | None) -> LossReduction | None:
    """The one scalar loss the graph returns, where it returns one."""
    return wide.losses[0] if wide is not None and len(wide.losses) == 1 else None


def loss_reduction(gm: torch.fx.GraphModule, loss: torch.fx.Node, rows: int | None) -> LossReduction:
    """How the scalar `loss` reduces over a batch of `rows` rows (step 3). The op found must reduce
    the batch's rows: its input's leading dim is `rows`, or a flattening of them (a view whose
    input leads with `rows`), in the example's shapes; else the batch was reduced before it, by
    an op not read here."""
    node = loss
    while node.op in CALLS:
        op, bound = ops.lookup(node, gm), ops.bind(node, gm)
        if op is None or bound is None:
            return LossReduction(loss.name, "unknown", f"{node.name} is no op graphopt knows")
        reduction = bound.params.get("reduction")
        reduction = ATEN_REDUCTIONS.get(reduction, reduction) if isinstance(reduction, int) else reduction
        reduces = reduction is not None or op.name in ("mean", "sum")
        if reduces and not _holds_rows(bound.operands[0], rows):
            return LossReduction(loss.name, "unknown", f"{op.name} ({node.name}) reduces a value without the "
                                                       "batch's rows")
        if op.name in COUNTED and reduction == "mean":
            if len(bound.operands) > 2 and bound.operands[2] is not None:
                return LossReduction(loss.name, "unknown", f"{op.name} weighted by class weights")
            target = bound.operands[1]
            return LossReduction(loss.name, "counted mean", f"{op.name} ({node.name})",
                                 target.name if isinstance(target, torch.fx.Node) else None,
                                 bound.params.get("ignore_index", -100))
        if reduction in ("mean", "batchmean"):
            return LossReduction(loss.name, "mean", f"{op.name} ({node.name}), reduction={reduction!r}")
        if reduction == "sum":
            return LossReduction(loss.name, "sum", f"{op.name} ({node.name}), reduction='sum'")
        if op.name in ("mean", "sum") and _whole(bound):
            return LossReduction(loss.name, op.name, f"{op.name} ({node.name})")
        tensors = [v for v in bound.operands if isinstance(v, torch.fx.Node)]
        if op.name not in PASSING or len(tensors) != 1:
            return LossReduction(loss.name, "unknown", f"{node.name} ({op.name})")
        node = tensors[0]
    return LossReduction(loss.name, "unknown", f"{node.name} is an input")


def counted_targets(gm: torch.fx.GraphModule, loss: LossReduction):
    """A function of the graph's inputs (as gm takes them) returning how many targets a counted
    mean counts, or None where the target is not computed from the inputs alone (a parameter or
    a random op on the way)."""
    if loss.kind != "counted mean" or loss.target is None:
        return None
    nodes = {n.name: n for n in gm.graph.nodes}
    needed, stack = {}, [nodes[loss.target]]
    while stack:
        n = stack.pop()
        if n.name in needed:
            continue
        if n.op in ("get_attr", "call_module") or (n.op in CALLS and may_draw(n, gm)):
            return None
        needed[n.name] = n
        stack.extend(n.all_input_nodes)
    graph, env = torch.fx.Graph(), {}
    for n in gm.graph.nodes:  # every placeholder, so the function takes gm's inputs
        if n.op == "placeholder" or n.name in needed:
            env[n] = graph.node_copy(n, env.__getitem__)
    target = env[nodes[loss.target]]
    counted = graph.call_function(operator.ne, (target, loss.ignore_index))
    graph.output(graph.call_method("sum", (counted,)))
    return torch.fx.GraphModule(gm, graph)


def graph_batch_rows(gm: torch.fx.GraphModule) -> int | None:
    """The example batch's rows: the fewest along dim 0 among the tensor inputs with a dim 0."""
    sizes = [i.shape[0] for n in gm.graph.nodes if n.op == "placeholder"
             if isinstance(i := tensor_info(n), TensorInfo) and len(i.shape)]
    return min(sizes, default=None)


def _holds_rows(value, rows: int | None) -> bool:
    """Whether value leads with the batch's rows, or is a view flattening them with what follows."""
    info = tensor_info(value) if isinstance(value, torch.fx.Node) else None
    if rows is None or not isinstance(info, TensorInfo) or not info.shape:
        return False
    if info.shape[0] == rows:
        return True
    source = value.all_input_nodes[0] if value.op in CALLS and value.all_input_nodes else None
    return (info.shape[0] % rows == 0 and ops.lookup(value, value.graph.owning_module) is not None
            and ops.lookup(value, value.graph.owning_module).name in ("view", "reshape", "flatten")
            and _holds_rows(source, rows))


def _whole(bound) -> bool:
    """A mean or sum over every dim (no dim given, or all of them)."""
    dims = bound.params.get("dim")
    return dims in (None, (), []) and not bound.params.get("keepdim", False)


def _where(node: torch.fx.Node) -> str:
    """The module a node runs in, with its class (`blocks.0.drop (Dropout)`), else the node's name."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return node.name
    path, cls = next(reversed(stack.values()))
    name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]  # export keeps a qualified name
    return f"{path} ({name})"


def _names(where: tuple[str, ...]) -> str:
    return ", ".join(where[:4]) + (f" and {len(where) - 4} more" if len(where) > 4 else "")
