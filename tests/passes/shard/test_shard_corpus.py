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
REPEAT = 4  # train_step's batch: the corpus batch of 2 rows 4 times, room for microbatches


def _case(name: str, rank: int, repeat: int = 1):
    case = build(name).repeated(repeat)
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
    from graphopt.runtime.fsdp import fully_shard_units, state_on_host

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
    host = state_on_host(gm)  # below what a rank reaches with its shards on the device: the device's part
    fully_shard_units(gm, mesh=init_device_mesh("cpu", (world,)))
    measured = step_peak(gm, torch.optim.AdamW(gm.parameters()), case.args, case.kwargs, host=host)["Total"]
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


def _steps(call, params, names):
    """Three AdamW steps of call() -> (losses, parameters after, the first step's gradients)."""
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    losses, grads = [], None
    for _ in range(3):
        losses.append(call())
        grads = grads or {n: p.grad.full_tensor() for n, p in zip(names, params) if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
    return losses, {n: p.full_tensor() for n, p in zip(names, params)}, grads, optimizer


def _weighted(model, case, parts, weights):
    """Eager's step over these microbatches, each one's backward weighted."""
    total = 0
    for (a, kw), w in zip(parts, weights):
        loss = case.loss(model(*a, **kw))
        (loss * w).backward()
        total = total + loss.detach() * w
    return total


def _train_step_rank(rank, world, name):
    """graphopt.train_step in 2 microbatches at their least budget per rank (the shards on the host,
    where that is less), and eager FSDP2 per block on the same weighted microbatches and on the whole
    batch, three AdamW steps each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from graphopt.passes.shard.rank_memory import step_peak
    from graphopt.runtime.fsdp import fully_shard_units, state_on_host
    from graphopt.runtime.microbatch import split_batch

    mesh = init_device_mesh("cpu", (world,))
    model, case = _case(name, rank, REPEAT)
    names = {id(p): n for n, p in model.named_parameters()}

    def train_step(budget_gb, **options):
        return graphopt.train_step(model, case.args, case.kwargs, shard="fsdp", world_size=world, optimizer="adamw",
                                   budget_gb=budget_gb, **options)

    with pytest.raises(graphopt.BudgetError) as e:
        train_step(1e-6, microbatches=2)
    budget_gb = e.value.min_budget_gb
    step = train_step(budget_gb, microbatches=2)
    weights = step.weights(*case.args, **case.kwargs)
    slack = step.report.passes[-1].stats["rank_collective_slack_bytes"]
    order, host = [names[id(p)] for p in step.graph.parameters()], state_on_host(step.graph)
    fully_shard_units(step.graph, mesh=mesh)
    *ours, optimizer = _steps(lambda: step(*case.args, **case.kwargs), list(step.graph.parameters()), order)
    measured = step_peak(step.graph, optimizer, case.args, case.kwargs, run=lambda: step(*case.args, **case.kwargs),
                         host=host)
    runs = {"graphopt": (*ours, host, budget_gb, step.predicted_peak_bytes, slack, measured["Total"])}
    for how, parts in (("microbatches", split_batch(case.args, case.kwargs, step.microbatches)),
                       ("whole", [(case.args, case.kwargs)])):
        model, case = _case(name, rank, REPEAT)
        blocks = [path for unit in step.report.passes[-1].stats["units"] for path in unit["blocks"]]
        for k, path in enumerate(blocks):
            fully_shard(model.get_submodule(path), mesh=mesh, reshard_after_forward=k < len(blocks) - 1)
        fully_shard(model, mesh=mesh)
        share = weights if how == "microbatches" else [1.0]
        runs[how] = _steps(lambda: _weighted(model, case, parts, share), list(model.parameters()),
                           [n for n, _ in model.named_parameters()])[:3]
    return runs


@pytest.mark.parametrize("name", ("hf_llama", "hf_gpt2"))
def test_corpus_train_step_fits_a_rank_s_budget_in_microbatches_as_eager_fsdp_runs_them(name):
    """At the least budget of 2 microbatches a rank (its shards on the host), train_step on 2 gloo
    ranks trains as eager FSDP2 per block on the same weighted microbatches, its first gradients the
    whole batch's; each rank's measured step (the device's part) within the budget and the prediction."""
    from graphopt.testing.gloo import on_gloo_ranks

    for rank, runs in enumerate(on_gloo_ranks(_train_step_rank, 2, name)):
        losses, params, grads, host, budget_gb, predicted, slack, measured = runs["graphopt"]
        print(f"{name} rank {rank}/2: shards on the host {host}, budget {budget_gb * 1e3:.3f} MB, predicted "
              f"{(predicted - slack) / 1e6:.3f} MB (+{slack / 1e6:.3f} MB a collective may hold), "
              f"measured {measured / 1e6:.3f} MB")
        assert host
        want_losses, want_params, _ = runs["microbatches"]
        for a, b in zip(losses, want_losses):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        for key in want_params:
            torch.testing.assert_close(params[key], want_params[key], rtol=1e-6, atol=1e-6, msg=key)
        whole_losses, _, whole_grads = runs["whole"]
        torch.testing.assert_close(losses[0], whole_losses[0], rtol=1e-6, atol=1e-6)
        assert grads.keys() == whole_grads.keys()
        for key, g in whole_grads.items():
            torch.testing.assert_close(grads[key], g, rtol=1e-5, atol=1e-6, msg=key)
        assert measured <= budget_gb * 1e9
        assert 0.97 * (predicted - slack) <= measured <= predicted
