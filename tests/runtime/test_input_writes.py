"""graphopt.runtime.input_writes: a model that writes into an input the caller gave it twice is
refused, as its trace read them as two."""
import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.errors import UsageError


class WritesItsInput(nn.Module):
    """A forward that writes into an argument: with y the same tensor, eager's y sees the write."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y):
        x.mul_(2)
        return self.lin(x).sum() + y.sum()


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_model_that_writes_into_an_aliased_input_is_refused(frontend):
    model = WritesItsInput()
    x = torch.randn(4, 8)
    with pytest.raises(UsageError, match="writes in place into its input 'x' or 'y'.*the example gives both one"):
        graphopt.optimize(model, (x, x), frontend=frontend, passes=[])
    with pytest.raises(UsageError, match="one storage"):  # a view shares its base's storage just the same
        graphopt.optimize(model, (x, x.view(4, 8)), frontend=frontend, passes=[])
    opt = graphopt.optimize(model, (x, x.clone()), frontend=frontend, passes=[])
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    a_eager = a.clone()
    torch.testing.assert_close(opt(a, b), model(a_eager, b))
    torch.testing.assert_close(a, a_eager)  # the graph writes the caller's tensor as eager does
    with pytest.raises(UsageError, match="this call gives both one storage"):
        opt(a, a)
