"""graphopt.passes.dce: dead pure ops removed, random ones kept, and export's assertions its input
guards settle dropped."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from conftest import assert_same_step
from pass_cases import Duplicates, run_one_pass


def test_dce_removes_dead_pure_ops_only():
    model, args = Duplicates(), (torch.randn(4, 8),)
    opt, record = run_one_pass("dce", model, args)
    assert record.stats["by_op"] == {"exp": 1}
    assert len([n for n in opt.graph.nodes if n.target is F.dropout]) == 3
    assert_same_step(model, opt, args, {}, exact=True)


class Casts(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, ids):
        keep = (ids > 0).to(torch.bool)
        unused = ids.cumsum(-1).to(torch.int64)  # noqa: F841
        return self.lin(x).to(torch.float32) * keep[..., None]


def _asserted(gm):
    return sorted(n.args[0].target.__name__ for n in gm.graph.nodes if "assert_tensor_metadata" in str(n.target))


def test_dce_drops_export_assertions_its_input_guards_settle():
    model, args = Casts(), (torch.randn(2, 5, 8), torch.randint(-3, 3, (2, 5)))
    kept = graphopt.optimize(model, args, passes="normalize", frontend="export")
    assert _asserted(kept) == ["cumsum.default", "gt.Scalar", "linear.default"]
    opt = graphopt.optimize(model, args, passes="normalize,dce", frontend="export")
    # ids' dtype is guarded on each call: what is computed from it alone without floats is settled,
    # and the dead cumsum goes with its assertion; linear's output reads parameters (model.half())
    assert _asserted(opt) == ["linear.default"]
    assert opt.graphopt_report.passes[-1].stats["by_op"] == {"assert_tensor_metadata": 2, "cumsum": 1, "to_dtype": 1}
    assert_same_step(model, opt, args, {}, exact=True)
    with pytest.raises(graphopt.UsageError, match="int32"):
        opt(args[0], args[1].int())  # the guard the dropped assertions rely on
