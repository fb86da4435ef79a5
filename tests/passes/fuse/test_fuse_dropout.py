"""Dropout in training inside fused groups: the call draws each mask as eager's dropout draws its
noise (same generator, same order), so the fused step equals eager's bit for bit where the ops
around it are exact; it keeps a bool mask, not eager's float noise; a group never spans another
node that draws, which would change the order of the draws."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_same_step, plain_and_fused_peaks
from test_fuse import fuse, fused_nodes, group_nodes, leaves, module

import graphopt

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def scaled_dropout(m, x, y):
    return m.drop(x * 2.0) + y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_a_dropout_joins_its_group_and_draws_eagers_mask(dtype, p):
    x, y = (torch.randn(5, 37, dtype=dtype, requires_grad=True) for _ in range(2))
    model, opt, stats = fuse(scaled_dropout, x, y, drop=nn.Dropout(p))
    assert group_nodes(stats) == [["mul", "drop", "add"]]
    assert stats["groups"][0]["ops"][:3] == ["mul", "where", "to_dtype" if dtype != torch.float32 else "mul"]
    assert_same_step(model, opt, (x, y), {})  # bit for bit: the same draws, eager's scale, eager's product


def test_the_group_draws_a_new_mask_each_call_and_a_copy_draws_the_same():
    x, y = leaves((64, 32), (64, 32))
    _, opt, _ = fuse(scaled_dropout, x, y, drop=nn.Dropout(0.5))
    torch.manual_seed(0)
    first, second = opt(x, y), opt(x, y)
    assert not torch.equal(first, second)
    torch.manual_seed(0)
    assert torch.equal(copy.deepcopy(opt)(x, y), first)


def test_a_dropout_joins_a_norm_and_a_softmax():
    """BERT's residual: dropout(dense) + input -> layer norm; GPT-2's attention: dropout(softmax)."""
    def fn(m, x, s):
        h = m.ln(m.drop(x) + x)
        return h, m.drop(F.softmax(s, -1))
    x, s = leaves((6, 40), (2, 3, 8, 8))
    model, opt, stats = fuse(fn, x, s, drop=nn.Dropout(0.1), ln=nn.LayerNorm(40))
    assert [sum(op == "where" for op in g["ops"]) for g in stats["groups"]] == [1, 1]
    assert all(g["rows"] for g in stats["groups"])
    assert_same_step(model, opt, (x, s), {}, exact=False)  # a mask not eager's would be off by O(1)


def test_a_group_does_not_span_another_draw():
    """d2 draws between d1 and the add: fusing the add with d1's group would draw d1's mask after d2's."""
    def fn(m, x, y, w):
        a = m.d1(x * 2.0)
        b = m.d2(x @ w) @ w
        return (a + y) * b
    x, y, w = leaves((4, 8), (4, 8), (8, 8))
    model, opt, stats = fuse(fn, x, y, w, d1=nn.Dropout(0.3), d2=nn.Dropout(0.3))
    assert group_nodes(stats) == [["mul", "d1"], ["add", "mul_1"]]
    assert stats["groups"][0]["not_fused"]["add"].startswith("d2 draws from the RNG between them")
    assert_same_step(model, opt, (x, y, w), {})


def test_a_group_whose_mask_would_be_smaller_than_it_is_declined_with_the_reason():
    """The call draws a mask at the group's shape; a dropout of a broadcast value would need another."""
    x, b = leaves((4, 8), (8,))
    model, opt, stats = fuse(lambda m, x, b: (x * 2.0) * m.drop(b + 1.0), x, b, drop=nn.Dropout(0.5))
    assert not stats["groups"]
    assert stats["declined"][0]["reason"] == "drop drops out a [8] value of a group of [4, 8]"
    assert_same_step(model, opt, (x, b), {})



def test_the_fused_step_keeps_a_bool_mask_and_the_estimate_sees_it():
    model = module(lambda m, x, y: (m.drop(torch.tanh(x)) * y).sum(), 2, drop=nn.Dropout(0.25))
    args = [torch.randn(256, 256, requires_grad=True) for _ in range(2)]
    opt, peaks = plain_and_fused_peaks(model, args)
    assert len(fused_nodes(opt)) == 1
    # eager keeps tanh's output and the float noise; the group keeps a bool mask (and its inputs)
    assert peaks["fused"] <= peaks["plain"] - 2 * 256 * 256 * 4


def test_cleanups_after_fuse_keep_each_draw():
    """Two fused groups alike, on the same inputs, draw two masks: cse must not merge them."""
    def fn(m, x, y):
        return m.drop(x * 2.0) + y, m.drop(x * 2.0) + y
    x, y = leaves((16, 16), (16, 16))
    model = module(fn, 2, drop=nn.Dropout(0.5))
    opt = graphopt.optimize(model, (x, y), passes="fuse,cse,dce", verify=True)
    assert len(fused_nodes(opt)) == 2
    assert_same_step(model, opt, (x, y), {})


def drop_path(x, p):
    """timm's drop_path in training, as timm writes it."""
    keep = 1 - p
    noise = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    noise.div_(keep)
    return x * noise


def normalized_and_fused(fn, *args, **modules):
    model = module(fn, len(args), **modules)
    opt = graphopt.optimize(model, args, passes="normalize,fuse", verify=True)
    return model, opt, opt.graphopt_report.passes[-1].stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stochastic_depth_draws_its_noise_in_the_group_at_any_batch_size(dtype):
    """The call draws torch.bernoulli's mask at the shape of the bernoulli's input, which it is
    given: the same draws as eager, also for a batch the graph was not traced with."""
    x, y, w = (torch.randn(*shape, dtype=dtype, requires_grad=True) for shape in [(4, 6, 8), (4, 6, 8), (8, 8)])
    model, opt, stats = normalized_and_fused(lambda m, x, y, w: drop_path(x @ w, 0.2) + y, x, y, w)
    assert group_nodes(stats) == [["bernoulli_", "div_", "mul_1", "add_1"]]
    (call,) = fused_nodes(opt)
    assert [a.name for a in call.args][0] == "new_empty"  # for its shape only
    assert_same_step(model, opt, (x, y, w), {})
    bigger = [torch.randn(7, 6, 8, dtype=dtype, requires_grad=True) for _ in range(2)] + [w]
    assert_same_step(model, opt, bigger, {})
    many = [torch.randn(64, 6, 8, dtype=dtype) for _ in range(2)] + [w]
    assert not torch.equal(opt(*many), opt(*many))  # a new mask each call


def test_torchvision_stochastic_depth_is_spelled_out_and_fused():
    import_torchvision = pytest.importorskip("corpus.vision_import").import_torchvision
    try:
        ops = import_torchvision().ops
    except ImportError:
        pytest.skip("torchvision is not installed")

    def fn(m, x, y, w):  # through its module, as torchvision's models call it: fx keeps the function whole
        h = x @ w
        return m.row(h * 2.0) + y, m.batch(h) + y, m.none(h + 1.0) * y
    x, y, w = leaves((4, 6, 8), (4, 6, 8), (8, 8))
    model, opt, stats = normalized_and_fused(fn, x, y, w, row=ops.StochasticDepth(0.3, "row"),
                                             batch=ops.StochasticDepth(0.3, "batch"), none=ops.StochasticDepth(0.0, "row"))
    assert opt.graphopt_report.passes[0].stats["stochastic_depths"] == 3
    assert [sum(op == "where" for op in g["ops"]) for g in stats["groups"]] == [1, 1, 0]
    assert_same_step(model, opt, (x, y, w), {})
    model.eval()
    evaluated = graphopt.optimize(model, (x, y, w), passes="normalize", verify=True)
    assert not [n for n in evaluated.graph.nodes if "stochastic_depth" in str(n.target) or "bernoulli" in n.name]


def test_a_bernoulli_of_a_tensor_of_probabilities_stays_out_with_the_reason():
    x, probs = leaves((4, 8), (4, 8))
    probs = probs.detach().sigmoid()
    model, opt, stats = normalized_and_fused(lambda m, x, q: x * 2.0 * torch.bernoulli(q) + x, x, probs)
    assert stats["groups"][0]["not_fused"]["bernoulli"].startswith("random (a bernoulli of a tensor of probabilities")
    torch.manual_seed(0)
    expected = model(x, probs)
    torch.manual_seed(0)
    assert torch.equal(opt(x, probs), expected)


def test_the_saved_tensors_of_a_fused_drop_path_are_its_mask_alone():
    """x * noise + y reads only the mask backward: the call keeps meta stand-ins of x and y,
    which hold no memory, and the saved-tensor analysis counts none of them."""
    from graphopt.analysis.saved import saved_tensors
    from graphopt.frontend.graph_inputs import placeholder_values

    x, y, w = leaves((4, 6, 8), (4, 6, 8), (8, 8))
    _, opt, _ = normalized_and_fused(lambda m, x, y, w: drop_path(x @ w, 0.2) + y, x, y, w)
    (call,) = fused_nodes(opt)
    saved = saved_tensors(opt, placeholder_values(opt, (x, y, w), {}))[call.name]
    assert [s.nbytes for s in saved] == [4]  # the bool mask of 4 samples
