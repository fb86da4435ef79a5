"""The shard pass on corpus models (make test-real): two transformers language models and a
vision transformer on two and four gloo ranks, each with its own batch. Three AdamW steps train as eager
FSDP2 sharding each block and the root; under a budget per rank, each rank's measured step is
within it and within 3% of the prediction."""
import pytest
import torch

import graphopt
from corpus import build

pytestmark = [pytest.mark.realmodels, pytest.mark.slow]
MODELS = ("hf_llama", "hf_gpt2", "hf_vit")


def _case(name: str, rank: int):
    case = build(name)
    pytest.importorskip("transformers")
    for m in case.model.modules():  # each rank would draw its own masks, in another order than eager's
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return case.model.train(), case.second(seed=100 + rank)


def _train(module, case, names):
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        loss = case.loss(module(*case.args, **case.kwargs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses, {name: p.full_tensor() for name, p in zip(names, module.parameters())}


def _rank(rank, world, name, how):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from graphopt.runtime.fsdp import fully_shard_units

    mesh = init_device_mesh("cpu", (world,))
    model, case = _case(name, rank)
    names = {id(p): n for n, p in model.named_parameters()}
    gm = graphopt.optimize(model, case.args, example_kwargs=case.kwargs, shard="fsdp")
    if how == "eager":
        blocks = [path for unit in gm.graphopt_report.passes[-1].stats["units"] for path in unit["blocks"]]
        for k, path in enumerate(blocks):
            fully_shard(model.get_submodule(path), mesh=mesh, reshard_after_forward=k < len(blocks) - 1)
        fully_shard(model, mesh=mesh)
        return _train(model, case, list(names.values()))
    order = [names[id(p)] for p in gm.parameters()]
    fully_shard_units(gm, mesh=mesh)
    return _train(gm, case, order)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_corpus_units_train_as_eager_fsdp_per_block(name, world):
    from graphopt.testing.gloo import on_gloo_ranks

    eager = on_gloo_ranks(_rank, world, name, "eager")
    ours = on_gloo_ranks(_rank, world, name, "graphopt")
    for (want_losses, want), (losses, got) in zip(eager, ours):
        for a, b in zip(losses, want_losses):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6, msg=key)


def _budget_rank(rank, world, name):
    from torch.distributed.device_mesh import init_device_mesh

    from graphopt.passes.shard.rank_memory import step_peak
    from graphopt.runtime.fsdp import fully_shard_units

    model, case = _case(name, rank)
    unplanned = graphopt.optimize(model, case.args, example_kwargs=case.kwargs, shard="fsdp", world_size=world,
                                  optimizer="adamw").graphopt_report.passes[-1].stats
    free = unplanned["rank_peak_bytes"] + unplanned["rank_collective_slack_bytes"]
    with pytest.raises(graphopt.BudgetError) as e:
        graphopt.optimize(model, case.args, example_kwargs=case.kwargs, shard="fsdp", world_size=world,
                          optimizer="adamw", budget_gb=free / 4e9)
    budget_gb = (e.value.min_budget_bytes + free) / 2e9  # halfway from a rank's least to its unplanned step
    gm = graphopt.optimize(model, case.args, example_kwargs=case.kwargs, shard="fsdp", world_size=world,
                           optimizer="adamw", budget_gb=budget_gb)
    stats = gm.graphopt_report.passes[-1].stats
    predicted, slack = stats["rank_peak_bytes"], stats["rank_collective_slack_bytes"]
    fully_shard_units(gm, mesh=init_device_mesh("cpu", (world,)))
    measured = step_peak(gm, torch.optim.AdamW(gm.parameters()), case.args, case.kwargs)["Total"]
    return free, budget_gb, predicted, slack, measured


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_corpus_rank_budget_holds_and_is_predicted(name, world):
    from graphopt.testing.gloo import on_gloo_ranks

    for rank, (free, budget_gb, predicted, slack, measured) in enumerate(on_gloo_ranks(_budget_rank, world, name)):
        print(f"{name} rank {rank}/{world}: unplanned {free / 1e6:.3f} MB, budget {budget_gb * 1e3:.3f} MB, predicted "
              f"{predicted / 1e6:.3f} MB (+{slack / 1e6:.3f} MB a collective may hold), measured {measured / 1e6:.3f} MB")
        assert measured <= budget_gb * 1e9
        assert 0.97 * predicted <= measured <= 1.03 * (predicted + slack)
