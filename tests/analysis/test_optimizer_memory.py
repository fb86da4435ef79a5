"""graphopt.analysis.optimizer_memory: the optimizer's state and step temporaries, as a real step makes them."""
import pytest
import torch

from graphopt.testing import zoo


def _real_optimizer_memory(model, optimizer):
    """State bytes and step temporaries of a real second step() (the first makes the state)."""
    from graphopt.analysis.live_storage import LiveStorage

    saved = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    resident = [*model.parameters(), *(p.grad for p in model.parameters()), *state]
    with LiveStorage(resident) as live:
        optimizer.step()
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
            p.grad = None
    optimizer.state.clear()
    return sum(t.untyped_storage().nbytes() for t in state), live.peak - live.live


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, weight_decay=0.1),  # weight decay copies every gradient
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam([{"params": list(ps)[:2], "lr": 1e-3}, {"params": list(ps)[2:]}]),
], ids=["adamw", "adam-decay", "sgd-momentum", "adam-groups"])
def test_optimizer_state_and_step_are_measured_as_a_real_step_makes_them(make):
    from graphopt.analysis.optimizer_memory import optimizer_memory

    model, _, _ = zoo.mlp(batch=8, width=128, depth=3)
    optimizer = make(model.parameters())
    predicted = optimizer_memory(optimizer, list(model.parameters()))
    assert (predicted.state_bytes, predicted.step_bytes) == _real_optimizer_memory(model, optimizer)
    assert not optimizer.state  # measuring it did not step the user's optimizer
