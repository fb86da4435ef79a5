"""The module optimize() returns without example inputs (runtime/lazy.py): a graph per kind of call."""
import torch

import graphopt
from graphopt.testing import zoo

from conftest import assert_same_step


def test_lazy_module_optimizes_per_kind_of_call_and_mode():
    model, args, kwargs = zoo.gpt(targets=False)
    lazy = graphopt.optimize(model)
    assert lazy.graph_module is None
    assert list(lazy.state_dict()) == list(model.state_dict())
    assert {id(p) for p in lazy.parameters()} == {id(p) for p in model.parameters()}
    assert_same_step(model, lazy, args, kwargs, exact=True)
    first = lazy.graph_module
    assert isinstance(first, torch.fx.GraphModule) and lazy.graphopt_report is not None
    longer = (torch.randint(0, 256, (2, 48)),)
    assert_same_step(model, lazy, longer, {}, exact=True)
    assert lazy.graph_module is first  # its graph (torch.fx) takes any length: built once
    lazy.eval()
    with torch.no_grad():
        torch.testing.assert_close(lazy(*args).logits, model(*args).logits, atol=0, rtol=0)
    assert lazy.graph_module.meta["graphopt_training"] is False
    assert lazy.blocks is model.blocks  # attributes resolve to the model's
