"""The pipeline partitioner: time against graph size, and balance against the usual splits.

- partition time (the whole pass: trace facts, DP, rewrite) on Llama-style models of 4 to 32
  blocks;
- on a model with uneven parts (a large embedding and LM head, blocks of different widths):
  imbalance (slowest stage cost over the mean, FLOPs) and the predicted bubble of a 1F1B
  schedule, for graphopt's cut, an equal-layer cut (Megatron, DeepSpeed "uniform") and an
  equal-parameter cut (DeepSpeed "parameters"), measured in the same run.
"""
import time

import pytest

import graphopt
from graphopt import zoo
from graphopt.partition import Partition, equal_layer_cuts, parameter_balanced_cuts, partition, stage_costs
from graphopt.passes.pipeline import stage_facts
from graphopt.trace import placeholder_values

UNEVEN = {"batch": 8, "seq": 64, "dim": 128, "heads": 4, "hidden": (256, 1024, 512, 1536, 768, 2048, 256, 512),
          "vocab": 4096}


@pytest.mark.parametrize("blocks", [4, 16, 32])
def test_partition_time(benchmark, quick, figures, blocks):
    if quick and blocks != 4:
        pytest.skip("quick mode runs the smallest model")
    model, args, kwargs = zoo.llama(batch=2, seq=16, hidden=(128,) * blocks)

    def run():
        start = time.perf_counter()
        staged = graphopt.optimize(model, args, example_kwargs=kwargs, passes=["pipeline{stages=4}"])
        return time.perf_counter() - start, staged

    seconds, staged = benchmark.pedantic(run, rounds=1, iterations=1)
    record = staged.graphopt_report.passes[-1]
    figures(blocks=blocks, nodes=record.nodes_before, pass_s=round(record.time_ms / 1e3, 3),
            optimize_s=round(seconds, 3))


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_balance_against_equal_layers_and_parameters(benchmark, quick, figures, stages):
    if quick and stages != 4:
        pytest.skip("quick mode runs 4 stages")
    model, args, kwargs = zoo.llama(**UNEVEN)
    gm = graphopt.optimize(model, args, example_kwargs=kwargs)
    facts = stage_facts(gm, placeholder_values(gm, args, kwargs))
    ours = benchmark.pedantic(lambda: partition(facts, stages), rounds=1, iterations=1)
    microbatches = 2 * stages
    row = {"stages": stages, "graphopt_imbalance": round(ours.imbalance, 3),
           "graphopt_bubble": round(ours.bubble(microbatches), 3)}
    for name, cuts in (("equal_layers", equal_layer_cuts(zoo.block_starts(gm), len(facts.cost), stages)),
                       ("equal_parameters", parameter_balanced_cuts(facts, stages))):
        other = Partition(cuts, stage_costs(facts.cost, cuts))
        row[f"{name}_imbalance"] = round(other.imbalance, 3)
        row[f"{name}_bubble"] = round(other.bubble(microbatches), 3)
    figures(**row)
