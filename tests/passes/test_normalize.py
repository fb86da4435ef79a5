"""graphopt.passes.normalize: spellings into torch functions, and the no-op dropouts, views, slices and
piecewise-filled buffers it removes."""
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt import ops
from conftest import assert_same_step
from pass_cases import run_one_pass


class Spellings(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.LeakyReLU(0.2)
        self.gelu = nn.GELU()

    def forward(self, x, y):
        a = x.relu() + y          # method + operator
        b = self.act(a) * 2.0     # stateless module + operator with a scalar
        c = 3.0 - b               # reversed operator: no torch.sub(3.0, b) form
        d = self.gelu(c).permute(1, 0)  # method with varargs: torch.permute takes a tuple
        return d.sum(0)


def test_normalize_rewrites_spellings_into_torch_functions():
    model, args = Spellings(), (torch.randn(4, 3, requires_grad=True), torch.randn(4, 3))
    opt, record = run_one_pass("normalize", model, args)
    targets = [n.target for n in opt.graph.nodes if n.op != "placeholder" and n.op != "output"]
    assert torch.relu in targets and torch.add in targets and torch.mul in targets
    assert F.leaky_relu in targets and F.gelu in targets
    assert "relu" not in targets and operator.add not in targets
    assert not any(n.op == "call_module" for n in opt.graph.nodes)
    assert operator.sub in targets  # 3.0 - b stays as written
    assert "permute" in targets
    assert record.stats["rewritten"] >= 6
    leaky = next(n for n in opt.graph.nodes if n.target is F.leaky_relu)
    assert 0.2 in leaky.args or leaky.kwargs.get("negative_slope") == 0.2
    assert_same_step(model, opt, args, {}, exact=True)


class GroupedAttention(nn.Module):
    """Attention with fewer key/value heads than query heads, the heads repeated as transformers'
    repeat_kv does (or tiled, which enable_gqa does not mean), with a mask or without."""

    def __init__(self, tiled: bool = False, masked: bool = True):
        super().__init__()
        self.q, self.kv = nn.Linear(16, 16), nn.Linear(16, 8)
        self.tiled = tiled
        self.register_buffer("mask", torch.ones(6, 6, dtype=torch.bool).tril() if masked else None)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 4).transpose(1, 2)
        k = self.kv(x).view(b, s, 2, 4).transpose(1, 2)
        v = (self.kv(x) * 2).view(b, s, 2, 4).transpose(1, 2)
        if self.tiled:
            k, v = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
        else:
            k = k[:, :, None, :, :].expand(b, 2, 2, s, 4).reshape(b, 4, s, 4)
            v = v[:, :, None, :, :].expand(b, 2, 2, s, 4).reshape(b, 4, s, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).sum(1)


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("masked", [True, False])
def test_normalize_lets_attention_repeat_key_value_heads_itself(frontend, masked):
    model, args = GroupedAttention(masked=masked), (torch.randn(2, 6, 16),)
    opt = graphopt.optimize(model, args, passes="normalize", frontend=frontend)
    assert opt.graphopt_report.passes[0].stats["grouped_query_attention"] == 1
    (attention,) = [n for n in opt.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert attention.kwargs["enable_gqa"] is True
    assert not [n for n in opt.graph.nodes if "expand" in str(n.target)]
    assert_same_step(model, opt, args, {}, exact=False)  # the head gradients summed in another order


def test_normalize_leaves_tiled_heads_alone():
    model, args = GroupedAttention(tiled=True), (torch.randn(2, 6, 16),)
    opt = graphopt.optimize(model, args, passes="normalize")
    assert opt.graphopt_report.passes[0].stats["grouped_query_attention"] == 0
    assert_same_step(model, opt, args, {}, exact=True)


class Dropouts(nn.Module):
    """Dropouts with p=0 (transformers' attention_dropout=0.0), as a module and a function, and
    one with p=0.5: in training only the last draws."""

    def __init__(self):
        super().__init__()
        self.lin, self.none, self.drop = nn.Linear(8, 8), nn.Dropout(0.0), nn.Dropout(0.5)

    def forward(self, x):
        y = self.none(self.lin(x)).relu()
        return F.dropout(y, 0.0, self.training) * 2 + self.drop(y)


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("training", [True, False])
def test_normalize_removes_dropouts_that_return_their_input(frontend, training):
    model, args = Dropouts().train(training), (torch.randn(4, 8),)
    opt = graphopt.optimize(model, args, passes="normalize", frontend=frontend)
    assert opt.graphopt_report.passes[0].stats["identity_dropouts"] == (2 if training else 3)
    random = [n for n in opt.graph.nodes if n.op.startswith("call") and getattr(ops.lookup(n, opt), "random", False)]
    assert len(random) == (1 if training else 0)
    assert_same_step(model, opt, args, {}, exact=True)  # bitwise, the RNG stream included


class SameLayoutViews(nn.Module):
    """A reshape to the shape a tensor has, a contiguous() of a contiguous one, and a detach."""

    def forward(self, x):
        v = (x * 2.0).reshape(x.shape).contiguous()
        return v.view(-1).detach() + v.view(4, 8).view(-1) * 3.0


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_normalize_removes_views_that_read_their_input_as_it_is_but_not_detach(frontend):
    model, args = SameLayoutViews(), (torch.randn(4, 8, requires_grad=True),)
    opt = graphopt.optimize(model, args, passes="normalize", frontend=frontend)
    left = [ops.lookup(n, opt).name for n in opt.graph.nodes if n.op.startswith("call")
            and getattr(ops.lookup(n, opt), "kind", None) == "view"]
    assert "detach" in left and "contiguous" not in left
    assert left == ["view", "detach", "view"]  # v.view(-1), twice; v.view(4, 8) and the reshape to x.shape were v
    assert_same_step(model, opt, args, {}, exact=True)


class StepLoop(nn.Module):
    """A scan over the sequence as Mamba's reference path writes it: `x[:, :, i]`, which export
    spells as slices of whole dimensions around a select; and `x[:4]`, whose end is the example's
    batch size."""

    def forward(self, x):
        h = torch.zeros_like(x[:, :, 0])
        outs = []
        for i in range(6):  # the sequence length, as a config fixes it
            h = h * 0.5 + x[:, :, i].sin()
            outs.append(h)
        return torch.stack(outs, dim=-1) + x[:4].sum()


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_normalize_reads_a_whole_slice_as_its_input_but_keeps_a_literal_end(frontend):
    model, args = StepLoop(), (torch.randn(4, 3, 6, requires_grad=True),)
    opt = graphopt.optimize(model, args, passes="normalize", frontend=frontend)
    ends = [n.args[3] for n in opt.graph.nodes if n.target is torch.ops.aten.slice.Tensor]
    if frontend == "export":
        assert opt.graphopt_report.passes[0].stats["identity_dropouts"] >= 6  # each x[:, :, i]'s slices
    assert ends == ([4] if frontend == "export" else [])  # fx keeps x[:4] as one getitem
    assert_same_step(model, opt, args, {}, exact=True)
    other = (torch.randn(6, 3, 6, requires_grad=True),)  # another batch size: x[:4] cuts it
    assert_same_step(model, opt, other, {}, exact=True)


class FilledKeys(nn.Module):
    """Keys built as DeepSeek-V3's attention builds them: an empty tensor, then copies into the
    slices of its last dimension; `gap` leaves its last column unwritten."""

    def __init__(self, gap: bool = False):
        super().__init__()
        self.nope, self.rot, self.gap = nn.Linear(8, 12), nn.Linear(8, 4), gap

    def forward(self, x):
        nope, rot = self.nope(x), self.rot(x)
        keys = nope.new_empty(*x.shape[:-1], 16)
        keys[..., :12] = nope
        keys[..., 12:15 if self.gap else 16] = rot[..., :3] if self.gap else rot
        if self.gap:
            keys[..., 15:] = 0.0
        return (keys.softmax(-1) * keys).sum()


@pytest.mark.parametrize("gap", [False, True])
def test_normalize_concatenates_a_buffer_filled_piecewise(gap):
    model, args = FilledKeys(gap), (torch.randn(2, 5, 8, requires_grad=True),)
    opt = graphopt.optimize(model, args, passes="normalize", frontend="export")
    writes = [n for n in opt.graph.nodes if n.target is torch.ops.aten.copy_.default]
    # filled by copies alone: one cat, no write; the last slice filled with a constant: kept
    assert opt.graphopt_report.passes[0].stats["filled_buffers"] == (0 if gap else 1)
    assert (len(writes), any(n.target is torch.ops.aten.cat.default for n in opt.graph.nodes)) == \
        ((2, False) if gap else (0, True))
    assert_same_step(model, opt, args, {}, exact=True)
    assert_same_step(model, opt, (torch.randn(3, 5, 8, requires_grad=True),), {}, exact=True)  # another batch
