"""Recompute after fuse: a fused call is a call like any other, rerun in a segment where the plan
puts it (its kernels only compute: the fuse pass records so on it), and a fused group whose outputs
lie in two blocks (a residual add and the next block's norm) runs in neither, so each block is still
one of the one-line plans. Checked against eager on a batch other than the example, forward and
backward. Kernels run under TRITON_INTERPRET=1."""
import copy

import pytest
import torch

import graphopt
from graphopt.analysis.blocks import module_paths, outer_blocks
from graphopt.analysis.effects import may_draw, state_effect
from graphopt.analysis.segments import SegmentCall
from graphopt.runtime.fused import FusedOp
from graphopt.runtime.fused_row import FusedRowOp
from graphopt.testing import zoo
from op_cases import seeded  # noqa: F401  (autouse: every test seeded)

FUSED = (FusedOp, FusedRowOp)


def _llama(layers=3):
    return zoo.llama(batch=4, seq=32, dim=64, heads=4, hidden=(128,) * layers)


def _fused(gm) -> list:
    return [n for n in gm.graph.nodes if isinstance(n.target, FUSED)]


def test_every_block_is_found_after_fuse():
    model, args, kwargs = _llama()
    gm = graphopt.optimize(model, args, kwargs, passes="fuse")
    assert _fused(gm), "the test needs fused calls"
    straddling = [n for n in _fused(gm) if not any(path.startswith("blocks.") for path in module_paths(n))]
    blocks = outer_blocks(list(gm.graph.nodes))
    assert sorted(blocks) == [f"blocks.{k}" for k in range(3)]
    assert straddling, "a group across two blocks (residual add, the next norm) belongs to neither"


def test_fused_calls_only_compute():
    model, args, kwargs = _llama()
    gm = graphopt.optimize(model, args, kwargs, passes="fuse")
    for n in _fused(gm):
        assert state_effect(n, gm) is None and not may_draw(n, gm)


def test_a_fused_dropout_draws_and_is_not_rerun():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.1), torch.nn.GELU(), torch.nn.Linear(16, 4))
    gm = graphopt.optimize(model, (torch.randn(8, 16),), passes="fuse")
    drawn = [n for n in _fused(gm) if n.target.draws]
    assert drawn, "the test needs a fused dropout"
    assert all(may_draw(n, gm) and state_effect(n, gm) for n in drawn)


def _segment_members(gm) -> list:
    return [m for n in gm.graph.nodes if isinstance(n.target, SegmentCall)
            for m in n.target.module.graph.nodes if m.op == "call_function"]


@pytest.mark.slow  # a least searched with fused kernels interpreted: make test-real
@pytest.mark.filterwarnings("ignore::graphopt.BudgetWarning")
def test_recompute_reruns_fused_calls_and_matches_eager_on_another_batch():
    model, args, kwargs = _llama()
    reference = copy.deepcopy(model)
    with pytest.raises(graphopt.BudgetError) as refused:  # a byte: the refusal names the least
        graphopt.optimize(model, args, kwargs, passes=["fuse", "recompute{budget_gb=1e-9}"])
    least = refused.value.min_budget_bytes
    opt = graphopt.optimize(model, args, kwargs, passes=["fuse", f"recompute{{budget_gb={least * 1.01 / 1e9:.9g}}}"])
    record = opt.graphopt_report.recompute()
    assert record.stats["segments"] >= 3
    rerun = [m for m in _segment_members(opt) if isinstance(m.target, FUSED)]
    assert rerun, "the plan at the least reruns the blocks' norms"

    idx = torch.randint(0, 256, args[0].shape)  # another batch, not the example
    targets = torch.randint(0, 256, args[0].shape)
    loss = opt(idx, targets=targets)
    expected = reference(idx, targets=targets)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(opt.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
