"""The recompute rewrite: segments run through torch.utils.checkpoint, same numbers, less memory."""
import copy

import pytest
import torch

import graphopt
from graphopt.analysis.memory import measure_step
from graphopt.reporting.dump import segment_code
from graphopt.passes.recompute.rewrite import checkpoint_segments, recomputable
from graphopt.runtime.checkpoint import RecomputeSegment
from graphopt.testing import zoo

from conftest import assert_same_step


def test_checkpointed_blocks_give_exact_gradients_with_dropout_and_less_memory():
    model, args, kwargs = zoo.gpt(batch=8, seq=64, layers=4)
    plain = graphopt.trace(model, args, kwargs)
    gm = graphopt.trace(model, args, kwargs)
    gm = checkpoint_segments(gm, zoo.block_segments(gm))
    assert sum(isinstance(n.target, RecomputeSegment) for n in gm.graph.nodes) == 4
    assert_same_step(model, gm, args, kwargs, exact=True)
    assert list(gm.state_dict()) == list(model.state_dict())
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}
    assert measure_step(gm, args, kwargs) < 0.5 * measure_step(plain, args, kwargs)
    code = segment_code(gm)
    assert code.count("recomputed during backward") == 4 and "scaled_dot_product_attention" in code


def test_only_segments_that_draw_save_the_rng_state():
    model, args, kwargs = zoo.gpt(batch=2, seq=16, layers=2)  # dropout in every block
    gm = graphopt.trace(model, args, kwargs)
    gm = checkpoint_segments(gm, zoo.block_segments(gm))
    assert [n.target.draws for n in gm.graph.nodes if isinstance(n.target, RecomputeSegment)] == [True, True]
    model, args, kwargs = zoo.convnet(blocks=2)
    gm = graphopt.trace(model, args, kwargs)
    calls = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function") and recomputable(n, gm) is None]
    gm = checkpoint_segments(gm, [calls[1:4]])
    segment = next(n.target for n in gm.graph.nodes if isinstance(n.target, RecomputeSegment))
    assert not segment.draws
    # no RNG state saved, and none needed: the rerun draws nothing
    torch.manual_seed(0)
    gm(*args).sum().backward()


@pytest.mark.parametrize("selective", [False, True])
@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_batchnorm_recomputes_with_statistics_updated_once(frontend, selective):
    model, args, kwargs = zoo.convnet(blocks=3)
    reference = copy.deepcopy(model)
    gm = graphopt.trace(model, args, kwargs, frontend=frontend)
    calls = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function") and recomputable(n, gm) is None]
    body = calls[1:-3]  # the stem's batch norm to the last block; the head stays plain
    gm = checkpoint_segments(gm, [body[: len(body) // 2], body[len(body) // 2:]], [selective] * 2)
    assert "batch_norm_once" in segment_code(gm)
    torch.manual_seed(0)
    reference(*args).sum().backward()
    gm(*args).sum().backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad), name
    for (name, got), want in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(got, want), name  # running statistics and num_batches_tracked: one update


def test_state_writes_are_not_recomputed():
    model, args, kwargs = zoo.convnet()
    gm = graphopt.trace(model, args, kwargs, frontend="export")
    count = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add_.Tensor)
    assert "writes state" in recomputable(count, gm)
    with pytest.raises(ValueError, match=f"{count.name} cannot be recomputed"):
        checkpoint_segments(gm, [[count]])


class PositionIds(torch.nn.Module):
    """RoBERTa's position ids: an int32 mask's running count, `.long()`, plus the padding index."""

    def __init__(self, cast_to=torch.int64):
        super().__init__()
        self.cast_to = cast_to
        self.embed = torch.nn.Embedding(16, 8)

    def forward(self, ids):
        mask = ids.ne(1).int()
        position = (mask.cumsum(1).type_as(mask) * mask).to(self.cast_to)
        position.add_(1)
        return self.embed(position.long()).sum(-1)


@pytest.mark.parametrize("cast_to", [torch.int64, torch.int32])
def test_a_write_into_a_cast_is_recomputed_where_the_cast_copies(cast_to):
    model, ids = PositionIds(cast_to), torch.tensor([[2, 3, 1, 4, 5], [6, 1, 1, 7, 8]])
    gm = graphopt.trace(model, (ids,), {})
    cast = next(n for n in gm.graph.nodes if n.target == "to")
    body = [n for n in gm.graph.nodes if n.op != "placeholder" and n.op != "output"]
    segment = body[body.index(cast):-1]  # from the cast: the mask it casts is made outside
    if cast_to == torch.int32:  # a cast to the dtype it has returns its input: the write would reach it
        with pytest.raises(ValueError, match="cannot be recomputed"):
            checkpoint_segments(gm, [segment])
        return
    gm = checkpoint_segments(gm, [segment])
    assert sum(isinstance(n.target, RecomputeSegment) for n in gm.graph.nodes) == 1
    assert_same_step(model, gm, (ids,), {}, exact=True)


def test_selective_segments_keep_matmul_outputs_and_give_exact_gradients():
    model, args, kwargs = zoo.gpt(batch=8, seq=64, layers=2)
    full = graphopt.trace(model, args, kwargs)  # nothing recomputed
    gm = graphopt.trace(model, args, kwargs)
    gm = checkpoint_segments(gm, zoo.block_segments(gm), [True, True])
    assert_same_step(model, gm, args, kwargs, exact=True)
    assert segment_code(gm).count("its matmul outputs kept") == 2
    hand = graphopt.trace(model, args, kwargs)
    hand = checkpoint_segments(hand, zoo.block_segments(hand))
    # Keeping the matmul outputs costs memory between full checkpointing and none.
    assert measure_step(hand, args, kwargs) < measure_step(gm, args, kwargs) < measure_step(full, args, kwargs)


def test_mlp_segments_match_eager():
    model, args, kwargs = zoo.mlp(batch=64, width=32, depth=3)
    gm = graphopt.trace(model, args, kwargs)
    body = [n for n in gm.graph.nodes if n.name.startswith("body_")]
    gm = checkpoint_segments(gm, [body[:4], body[4:8], body[8:]])
    assert_same_step(model, gm, args, kwargs, exact=True)


# Three library ops the registry does not know: one that only computes (as transformers'
# grouped_mm_fallback), one that writes an argument, one that draws from the RNG.
@torch.library.custom_op("graphopt_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.library.custom_op("graphopt_test::scaled_and_counted", mutates_args=("count",))
def _scaled_and_counted(x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    count.add_(1)
    return x * 2


@torch.library.custom_op("graphopt_test::noisy", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _noisy(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand_like(x)


for _op in (_scaled, _scaled_and_counted, _noisy):
    _op.register_fake(lambda x, *rest: torch.empty_like(x))
for _op in (_scaled, _noisy):  # torch takes no autograd formula for an op that writes
    _op.register_autograd(lambda ctx, g: 2 * g)


class LibraryOps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        h = self.linear(x).tanh()
        scaled = torch.ops.graphopt_test.scaled(h).add_(1)  # a write into the op's fresh result
        return (scaled.tanh() + torch.ops.graphopt_test.scaled_and_counted(h.detach(), self.count)
                + torch.ops.graphopt_test.noisy(h)).sum()


def test_a_library_op_may_be_recomputed_when_its_schema_says_it_only_computes():
    model, x = LibraryOps(), torch.randn(4, 8)
    gm = graphopt.trace(model, (x,), frontend="export")
    why = {n.target.name(): recomputable(n, gm) for n in gm.graph.nodes
           if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "graphopt_test"}
    assert why["graphopt_test::scaled"] is None
    assert why["graphopt_test::scaled_and_counted"] == ("opaque call: it dispatches "
                                                         "graphopt_test.scaled_and_counted.default writes count")
    assert why["graphopt_test::noisy"] == ("opaque call: it dispatches graphopt_test.noisy.default, which draws "
                                           "random numbers")
    scaled = next(n for n in gm.graph.nodes if getattr(n.target, "name", lambda: "")() == "graphopt_test::scaled")
    (write,) = scaled.users
    assert "writes state" in recomputable(write, gm)  # alone; in a segment with the op, it writes what the segment made
    gm = checkpoint_segments(gm, [[scaled.args[0], scaled, write, *write.users]])
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    reference(x).backward()
    torch.manual_seed(0)
    gm(x).backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(got.grad, want.grad), name
