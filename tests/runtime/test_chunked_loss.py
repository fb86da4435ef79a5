"""graphopt.runtime.chunked_loss: a head and its loss run over chunks of rows, summed as eager sums
them, and backward once only."""
import pytest
import torch
import torch.nn.functional as F

from graphopt.runtime.chunked_loss import ChunkedHeadLoss
from graphopt.runtime.fused_row import FusedRowOp


def test_a_chunked_head_sums_its_chunks_as_eager_and_refuses_a_second_backward():
    from graphopt.codegen.row_group import cross_entropy

    h, weight, bias = torch.randn(37, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True), \
        torch.randn(50, requires_grad=True)
    target = torch.randint(0, 50, (37,))
    target[3] = -100
    for reduction in ("mean", "sum"):
        op = ChunkedHeadLoss(FusedRowOp(cross_entropy(), ((reduction, 1, -100),)), 0, chunk=8)
        loss = op(h, weight, bias, target)
        want = F.cross_entropy(F.linear(h, weight, bias), target, reduction=reduction)
        torch.testing.assert_close(loss, want)
        got = torch.autograd.grad(loss, (h, weight, bias), retain_graph=True)
        for g, w in zip(got, torch.autograd.grad(want, (h, weight, bias))):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        with pytest.raises(RuntimeError, match="backpropagated through once"):
            torch.autograd.grad(loss, (h,))
    with pytest.raises(IndexError, match="Target 50 is out of bounds"):
        op(h, weight, bias, torch.full((37,), 50))
