"""The recompute rewrite: segments run through torch.utils.checkpoint, same numbers, less memory."""
import pytest

import graphopt
from graphopt import zoo
from graphopt.checkpointing import RecomputeSegment, checkpoint_segments, recomputable, segment_code
from graphopt.memory import measure_step

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


def test_batchnorm_in_training_is_not_recomputed():
    model, args, kwargs = zoo.convnet()
    gm = graphopt.trace(model, args, kwargs)
    bn = next(n for n in gm.graph.nodes if n.name == "stem_1")
    assert "writes state" in recomputable(bn, gm)
    with pytest.raises(ValueError, match="stem_1 cannot be recomputed"):
        checkpoint_segments(gm, [[bn]])
    conv = next(n for n in gm.graph.nodes if n.name == "blocks_0_conv1")
    assert recomputable(conv, gm) is None


def test_mlp_segments_match_eager():
    model, args, kwargs = zoo.mlp(batch=64, width=32, depth=3)
    gm = graphopt.trace(model, args, kwargs)
    body = [n for n in gm.graph.nodes if n.name.startswith("body_")]
    gm = checkpoint_segments(gm, [body[:4], body[4:8], body[8:]])
    assert_same_step(model, gm, args, kwargs, exact=True)
