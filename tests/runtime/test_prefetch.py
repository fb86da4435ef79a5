"""graphopt.prefetch: the loader's batches, in order and whole, on the device, `depth` read ahead;
on CPU the same loop with `.to(device)` for the copy (the side stream is CUDA's: make gpu). With
optimize(prefetch=depth), the budget keeps room for the batches held ahead."""
import collections

import pytest
import torch

import graphopt
from graphopt.testing import zoo

Pair = collections.namedtuple("Pair", "x y")


def _batches(n=5):
    return [{"x": torch.full((2, 3), float(k)), "y": (torch.tensor([k]), [torch.ones(1) * k, "label"]),
             "pair": Pair(torch.zeros(1), k)} for k in range(n)]


def test_every_batch_in_order_and_whole():
    loader = _batches()
    got = list(graphopt.prefetch(loader, "cpu", depth=2))
    assert len(got) == len(loader)
    for a, b in zip(got, loader):
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"][0], b["y"][0]) and a["y"][1][1] == "label"
        assert isinstance(a["y"][1], list) and isinstance(a["pair"], Pair) and a["pair"].y == b["pair"].y


def test_it_reads_depth_batches_ahead_and_no_more():
    pulled = []

    class Loader:
        def __iter__(self):
            for k in range(6):
                pulled.append(k)
                yield torch.tensor([k])

    it = iter(graphopt.prefetch(Loader(), "cpu", depth=3))
    assert len(pulled) == 3
    assert next(it).item() == 0 and len(pulled) == 4  # the next copy starts as a batch is handed out
    assert [t.item() for t in it] == [1, 2, 3, 4, 5]


def test_each_iteration_is_an_epoch_and_len_is_the_loader_s():
    fetched = graphopt.prefetch(torch.utils.data.DataLoader(torch.arange(10.0), batch_size=4), "cpu")
    assert len(fetched) == 3
    assert [len(b) for b in fetched] == [4, 4, 2] == [len(b) for b in fetched]


@pytest.mark.parametrize("depth", [0, -1, True, 1.5, "2"])
def test_a_depth_that_is_not_a_count_is_refused(depth):
    with pytest.raises(graphopt.OptionError, match="depth is how many batches"):
        graphopt.prefetch([], "cpu", depth=depth)


def test_what_is_not_a_loader_or_device_is_refused():
    with pytest.raises(graphopt.UsageError, match="not iterable"):
        graphopt.prefetch(3, "cpu")
    with pytest.raises(graphopt.UsageError, match="not a device torch knows"):
        graphopt.prefetch([], "gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a CUDA device on a CPU build")
def test_cuda_on_a_cpu_build_is_refused_before_any_batch():
    with pytest.raises(graphopt.UsageError, match="CUDA"):
        graphopt.prefetch([torch.ones(1)], "cuda")


@pytest.mark.filterwarnings("ignore::graphopt.BudgetWarning")  # 50 MB holds the step as traced
def test_the_budget_keeps_room_for_the_batches_held_ahead():
    torch.manual_seed(0)
    model, args, _ = zoo.mlp(batch=256, width=64, depth=3)
    plans = {}
    for depth in (None, 3):
        opt = graphopt.optimize(model, args, budget_gb=0.05, prefetch=depth, plan_cache=False)
        plans[depth] = opt.graphopt_report.recompute()
    batch = args[0].numel() * args[0].element_size()
    assert plans[None].budget.planned_for_bytes - plans[3].budget.planned_for_bytes == 3 * batch
    assert plans[3].stats["prefetched_bytes"] == 3 * batch and "prefetched_bytes" not in plans[None].stats


def test_prefetch_without_a_budget_is_refused():
    model, args, _ = zoo.mlp()
    with pytest.raises(graphopt.OptionError, match="prefetch= refines what budget_gb= asks for"):
        graphopt.optimize(model, args, prefetch=2)
