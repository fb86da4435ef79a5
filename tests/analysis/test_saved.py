"""graphopt.analysis.saved: the tensors a step saves for backward, attributed to their nodes, and the
calls a selective checkpoint policy sees."""
import torch

import graphopt
from graphopt.analysis.saved import saved_tensors
from graphopt.testing import zoo
from graphopt.frontend.graph_inputs import placeholder_values


def test_saved_tensors_are_attributed():
    model, args, kwargs = zoo.gpt(layers=1)
    gm = graphopt.trace(model, args, kwargs)
    saved = saved_tensors(gm, placeholder_values(gm, args, kwargs))
    fc = saved["blocks_0_fc"]  # nn.Linear saves its input and its weight
    assert {(s.source, s.owner) for s in fc} == {("node", "blocks_0_ln2"), ("state", "blocks.0.fc.weight")}
    ln = saved["blocks_0_ln1"]  # LayerNorm: its input, weight and bias, and mean/rstd made inside
    assert sum(s.source == "internal" for s in ln) == 2
    assert all(s.source != "internal" for s in saved["gelu"])  # gelu saves its input, a node output


def test_relu_saving_its_result_is_not_counted_twice():
    model, args, kwargs = zoo.convnet()
    gm = graphopt.trace(model, args, kwargs)
    saved = saved_tensors(gm, placeholder_values(gm, args, kwargs))
    assert [(s.source, s.owner) for s in saved["relu"]] == [("node", "relu")]


def test_policy_calls_are_the_calls_a_selective_checkpoint_policy_sees():
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from graphopt.analysis.saved import record_step
    from graphopt.runtime.checkpoint import batch_norm_once

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(4)

        def forward(self, x):
            y = torch.relu(self.fc(x))  # a linear on a 3-d input: a view, the weight's t, addmm, a view
            return batch_norm_once(y, self.bn.weight, self.bn.bias, self.bn.running_mean, self.bn.running_var, 0.1, 1e-5)

    block, x = Block(), torch.randn(2, 4, 8, requires_grad=True)
    seen = []

    def policy(ctx, op, *args, **kwargs):
        if not ctx.is_recompute:
            seen.append(op)
        return CheckpointPolicy.PREFER_RECOMPUTE

    checkpoint(block, x, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(policy)).sum().backward()
    graph = torch.fx.Graph()  # the block as a rewritten segment holds it: batch_norm_once one call
    y = graph.call_function(torch.relu, (graph.call_module("fc", (graph.placeholder("x"),)),))
    state = [graph.get_attr(f"bn.{name}") for name in ("weight", "bias", "running_mean", "running_var")]
    graph.output(graph.call_function(batch_norm_once, (y, *state, 0.1, 1e-5)))
    calls = record_step(torch.fx.GraphModule(block, graph), [x.detach()]).policy_calls
    assert sum(calls.values()) == len(seen)
    assert calls["fc"] == 4 and calls["relu"] == 1 and calls["batch_norm_once"] > 4  # copies of the statistics
