"""graphopt.passes.cse: pure ops merged, random ones and ops across a mutation kept apart."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from conftest import assert_same_step
from pass_cases import Duplicates, run_one_pass


def test_cse_merges_pure_ops_but_not_random_ones():
    model, args = Duplicates(), (torch.randn(4, 8),)
    opt, record = run_one_pass("cse", model, args)
    assert record.stats["by_op"].get("sin") == 1
    # in training a differentiated value stays unmerged: its gradients would sum in another order
    assert "linear" not in record.stats["by_op"]
    assert "dropout" not in record.stats["by_op"]
    drops = [n for n in opt.graph.nodes if n.target is F.dropout]
    assert len(drops) == 3
    assert_same_step(model, opt, args, {}, exact=True)
    inference = graphopt.optimize(model, args, passes=["cse"], train=False)
    assert inference.graphopt_report.passes[0].stats["by_op"] == {"sin": 1, "linear": 1}


class Mutating(nn.Module):
    def forward(self, x):
        y = x * 1.0
        a = y + 1
        y.add_(5)  # in-place: y + 1 after this is a different value
        b = y + 1
        return a * b


def test_cse_does_not_merge_across_mutation():
    model, args = Mutating(), (torch.randn(5, requires_grad=True),)
    opt, record = run_one_pass("cse", model, args)
    assert not record.changed
    assert_same_step(model, opt, args, {}, exact=True)
