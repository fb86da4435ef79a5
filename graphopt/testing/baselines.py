"""What tests and benchmarks measure graphopt against: budgets at a share of a step's peak,
the pipeline partitions of other libraries (equal layers, equal parameters), and eager run
microbatch by microbatch."""
from __future__ import annotations

import torch

from ..analysis.batch_wide import traced_loss
from ..analysis.memory import GB, Estimate
from ..frontend.batch import batch_rows
from ..passes.pipeline.partition import Partition, StageFacts, partition
from ..runtime.microbatch import split_batch
from ..runtime.microbatch_call import merge_outputs
from ..runtime.microbatch_step import loss_weights, reduction_of


class Microbatched(torch.nn.Module):
    """Eager on the microbatches PipelineRunner would cut a batch into, outputs merged as the
    staged graph merges them: what a staged graph called with a whole batch must equal. graph:
    the staged graph, whose loss's reduction weighs the microbatches' losses (a mean without)."""

    def __init__(self, model: torch.nn.Module, microbatches: int, graph: torch.fx.GraphModule | None = None):
        super().__init__()
        self.model, self.microbatches, self.graph = model, microbatches, graph

    def forward(self, *args, **kwargs):
        parts = split_batch(args, kwargs, self.microbatches)
        report = getattr(self.graph, "graphopt_report", None)
        loss = traced_loss(report.batch_wide) if report is not None else None
        shares = loss_weights(self.graph, parts, reduction_of(loss), loss) if report is not None else None
        return merge_outputs([self.model(*a, **k) for a, k in parts], [batch_rows(a, k) for a, k in parts], shares)


def budget_at(estimate: Estimate, f: float) -> float:
    """The budget in GB that keeps parameters and gradients and f of the rest of the step's peak."""
    fixed = 2 * estimate.breakdown.get("parameters", 0)
    return (fixed + f * (estimate.peak_bytes - fixed)) / GB


def stage_costs(cost: list[float], cuts: list[int]) -> list[float]:
    return [float(sum(cost[cuts[s]:cuts[s + 1]])) for s in range(len(cuts) - 1)]


def imbalance(costs: list[float]) -> float:
    """Slowest stage over the mean stage: 1.0 is perfect balance."""
    return Partition([], costs).imbalance


def parameter_balanced_cuts(facts: StageFacts, stages: int) -> list[int]:
    """The baseline DeepSpeed's partition_method="parameters" stands for: stages holding equal
    parameter bytes (a node weighs what it reads), cut at the same allowed places."""
    weights = [float(sum(p.values())) for p in facts.params]
    by_params = StageFacts(weights, facts.kept, facts.params, facts.cross, facts.can_cut, facts.state_factor,
                           facts.work)
    return partition(by_params, stages).cuts


def equal_layer_cuts(layer_starts: list[int], nodes: int, stages: int) -> list[int]:
    """The baseline of Megatron and DeepSpeed's "uniform": the same number of layers per stage
    (the embedding goes with the first, the head with the last); layer_starts are the node
    positions where each layer begins."""
    layers = len(layer_starts)
    return [0] + [layer_starts[round(s * layers / stages)] for s in range(1, stages)] + [nodes]
