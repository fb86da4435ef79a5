import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt import ops, passes
from graphopt.passes import parse_pipeline
from graphopt.testing import zoo

from conftest import FX_ZOO, assert_same_step


def test_pipeline_text():
    pipeline = parse_pipeline("normalize, cse ,dce")
    assert [p.name for p in pipeline] == ["normalize", "cse", "dce"]
    assert [p.spec() for p in parse_pipeline(["dce", ("cse", {})])] == ["dce", "cse"]
    for bad, match in [("cse{", "unclosed"), ("cse}", "unmatched"), ("cse{x}", "key=value"),
                       ("nope", "available passes: cse, dce, "), ("dce{verbose=1}", "options are: none")]:
        with pytest.raises(graphopt.OptionError, match=match):
            parse_pipeline(bad)


def test_options_are_converted_and_checked():
    from dataclasses import dataclass

    from graphopt.passes import Option, Pass, PassResult
    from graphopt.passes.base import Text, option, to_bool

    @dataclass(frozen=True)
    class DemoOptions:
        k: int = option(2, int, "a count")
        mode: str = option("a", str, "a mode", choices=("a", "b"))
        on: bool = option(False, to_bool, "a switch")

    class Demo(Pass):
        name = "demo-options"
        Options = DemoOptions

        def run(self, gm, ctx):
            return PassResult(gm, False)

    p = Demo(k=Text("5"), on=Text("true"))  # as a pipeline string gives them
    assert p.settings == DemoOptions(k=5, mode="a", on=True) and p.settings.k == 5
    assert p.spec() == "demo-options{k=5,on=True}"
    with pytest.raises(graphopt.OptionError, match="bad value"):
        Demo(k=Text("five"))
    with pytest.raises(graphopt.OptionError, match="a, b"):
        Demo(mode="c")
    # a Python value must already be of the option's type: text is parsed only from pipelines
    with pytest.raises(graphopt.OptionError, match="must be True or False"):
        Demo(on="true")
    with pytest.raises(graphopt.OptionError, match="optimize\\(budget_gb=...\\).*positive, finite"):
        graphopt.optimize(*zoo.mlp()[:2], budget_gb="8")
    with pytest.raises(TypeError, match="frozen dataclass"):  # options as a dict would be dropped silently
        type("Old", (Pass,), {"name": "old-options", "options": {"k": Option(2, int, "a count")}})


def _run(pass_name, model, args, kwargs=None):
    opt = graphopt.optimize(model, args, example_kwargs=kwargs or {}, passes=[pass_name], verify=True)
    return opt, opt.graphopt_report.passes[0]


@pytest.mark.parametrize("name", FX_ZOO)
@pytest.mark.parametrize("pass_name", ["normalize", "cse", "dce"])
def test_each_pass_keeps_outputs_and_gradients(name, pass_name):
    model, args, kwargs = FX_ZOO[name]()
    opt, _ = _run(pass_name, model, args, kwargs)
    assert_same_step(model, opt, args, kwargs, exact=False, tol=1e-6)


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_bert"])
def test_default_pipeline_on_transformers(name):
    pytest.importorskip("transformers")
    model, args, kwargs = zoo.HF_ZOO[name]()
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, verify=True)
    assert_same_step(model, opt, args, kwargs, exact=False, tol=1e-6)


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
    opt, record = _run("normalize", model, args)
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


class Duplicates(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        a = torch.sin(x) + torch.sin(x)
        b = self.lin(x) * self.lin(x)
        d1 = F.dropout(x, 0.5, self.training)
        d2 = F.dropout(x, 0.5, self.training)
        unused = torch.exp(x)  # noqa: F841  (dead, pure)
        _ = F.dropout(x, 0.5, self.training)  # dead but random: must stay
        return a + b + d1 + d2


def test_cse_merges_pure_ops_but_not_random_ones():
    model, args = Duplicates(), (torch.randn(4, 8),)
    opt, record = _run("cse", model, args)
    assert record.stats["by_op"].get("sin") == 1
    # in training a differentiated value stays unmerged: its gradients would sum in another order
    assert "linear" not in record.stats["by_op"]
    assert "dropout" not in record.stats["by_op"]
    drops = [n for n in opt.graph.nodes if n.target is F.dropout]
    assert len(drops) == 3
    assert_same_step(model, opt, args, {}, exact=True)
    inference = graphopt.optimize(model, args, passes=["cse"], train=False)
    assert inference.graphopt_report.passes[0].stats["by_op"] == {"sin": 1, "linear": 1}


def test_dce_removes_dead_pure_ops_only():
    model, args = Duplicates(), (torch.randn(4, 8),)
    opt, record = _run("dce", model, args)
    assert record.stats["by_op"] == {"exp": 1}
    assert len([n for n in opt.graph.nodes if n.target is F.dropout]) == 3
    assert_same_step(model, opt, args, {}, exact=True)


class Casts(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, ids):
        keep = (ids > 0).to(torch.bool)
        unused = ids.cumsum(-1).to(torch.int64)  # noqa: F841
        return self.lin(x).to(torch.float32) * keep[..., None]


def _asserted(gm):
    return sorted(n.args[0].target.__name__ for n in gm.graph.nodes if "assert_tensor_metadata" in str(n.target))


def test_dce_drops_export_assertions_its_input_guards_settle():
    model, args = Casts(), (torch.randn(2, 5, 8), torch.randint(-3, 3, (2, 5)))
    kept = graphopt.optimize(model, args, passes="normalize", frontend="export")
    assert _asserted(kept) == ["cumsum.default", "gt.Scalar", "linear.default"]
    opt = graphopt.optimize(model, args, passes="normalize,dce", frontend="export")
    # ids' dtype is guarded on each call: what is computed from it alone without floats is settled,
    # and the dead cumsum goes with its assertion; linear's output reads parameters (model.half())
    assert _asserted(opt) == ["linear.default"]
    assert opt.graphopt_report.passes[-1].stats["by_op"] == {"assert_tensor_metadata": 2, "cumsum": 1, "to_dtype": 1}
    assert_same_step(model, opt, args, {}, exact=True)
    with pytest.raises(graphopt.UsageError, match="int32"):
        opt(args[0], args[1].int())  # the guard the dropped assertions rely on


class Mutating(nn.Module):
    def forward(self, x):
        y = x * 1.0
        a = y + 1
        y.add_(5)  # in-place: y + 1 after this is a different value
        b = y + 1
        return a * b


def test_cse_does_not_merge_across_mutation():
    model, args = Mutating(), (torch.randn(5, requires_grad=True),)
    opt, record = _run("cse", model, args)
    assert not record.changed
    assert_same_step(model, opt, args, {}, exact=True)


@torch.fx.wrap
def mystery(x):
    return x * 2


class Opaque(nn.Module):
    def forward(self, x):
        unused = mystery(x)  # noqa: F841  opaque: may have side effects, stays
        return mystery(x) + mystery(x)


def test_unknown_ops_are_left_alone():
    model, args = Opaque(), (torch.randn(3, requires_grad=True),)
    opt = graphopt.optimize(model, args, verify=True)
    assert len([n for n in opt.graph.nodes if n.target is mystery]) == 3


def test_available_passes_are_all_implemented():
    for name, cls in passes.available().items():
        assert cls.run is not passes.Pass.run, name
        assert cls.__doc__ and cls.name == name


def test_manager_annotates_new_and_invalidated_nodes():
    from graphopt.analysis.meta import invalidate, tensor_info
    from graphopt.passes import Pass, PassResult

    class Widen(Pass):
        """Appends a cat that doubles the output, and retargets the head in place."""

        name = "widen"

        def run(self, gm, ctx):
            out = next(n for n in gm.graph.nodes if n.op == "output")
            head = out.args[0]
            with gm.graph.inserting_before(out):
                cat = gm.graph.call_function(torch.cat, ([head, head],))
            out.replace_input_with(head, cat)
            relu = next(n for n in gm.graph.nodes if n.name == "relu")
            relu.target = torch.sigmoid  # computes something else now
            invalidate(relu)
            return PassResult(gm, True)

    model, args, _ = zoo.mlp(batch=8)
    opt = graphopt.optimize(model, args, passes=[Widen()])
    cat = next(n for n in opt.graph.nodes if n.target is torch.cat)
    assert tensor_info(cat).shape == (16, 10)
    assert tensor_info(next(n for n in opt.graph.nodes if n.name == "relu")) is not None


def test_a_pass_that_must_run_after_another_is_refused_before_it():
    model, args = Duplicates(), (torch.randn(4, 8),)
    with pytest.raises(graphopt.OptionError, match="'inplace' comes before 'precision'.*Put 'precision' first"):
        graphopt.optimize(model, args, passes="inplace,precision{precision=bf16}")
    with pytest.raises(graphopt.OptionError, match="'recompute' comes before 'fuse'"):
        graphopt.optimize(model, args, passes="recompute{budget_gb=1},fuse")


def test_optimize_places_the_passes_its_arguments_ask_for_in_order():
    model, args = Duplicates(), (torch.randn(4, 8),)
    opt = graphopt.optimize(model, args, passes="normalize,inplace", precision="bf16", budget_gb=1.0)
    assert [p.name for p in opt.graphopt_report.passes] == ["normalize", "precision{precision=bf16}", "inplace",
                                                            "recompute{budget_gb=1.0}"]


def test_each_pass_builds_itself_from_the_one_checked_record():
    from graphopt.api import build_pipeline
    from graphopt.api import checked_options

    options = checked_options(dict(budget_gb=2.0, precision="fp16", precision_policy="softmax:fp32", optimizer="sgd"))
    assert options.budget_bytes == 2 * 10**9  # bytes from the entry on
    built = {p.name: p.settings for p in build_pipeline("dce", options)}
    assert (built["recompute"].budget_bytes, built["recompute"].optimizer) == (2 * 10**9, "sgd")
    assert (built["precision"].precision, built["precision"].precision_policy) == ("fp16", "softmax:fp32")
    staged = {p.name: p.settings for p in build_pipeline("dce", checked_options(dict(stages=2, budget_gb=2.0)))}
    # an argument not given leaves its option at the default: each stage holds adam's state
    assert "recompute" not in staged and (staged["pipeline"].budget_bytes, staged["pipeline"].optimizer) == (2 * 10**9,
                                                                                                           "adam")
    with pytest.raises(graphopt.OptionError, match=r"optimize\(budget_gb=...\): bad value -1"):
        checked_options(dict(budget_gb=-1))
    # the pass made from the record and the one a pipeline string names are one pass
    assert parse_pipeline("recompute{budget_gb=2.0 optimizer=sgd}")[0].settings == built["recompute"]


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


class CausalAttention(nn.Module):
    """Attention whose boolean mask is built from the sequence length alone, as exported
    transformers models build theirs: causal, or within a sliding window (causal while the
    sequence is no longer than the window), or made from the input's values or from a buffer."""

    def __init__(self, mask: str = "causal", window: int = 8):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.kind, self.window = mask, window
        self.register_buffer("tril", torch.ones(6, 6, dtype=torch.bool).tril())

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 4).permute(2, 0, 3, 1, 4)
        if self.kind == "buffer":
            mask = self.tril[:s, :s]
        else:
            i = torch.arange(s, device=x.device)
            mask = i[None, :] <= i[:, None]
            if self.kind == "window":
                mask = mask & (i[:, None] - i[None, :] < self.window)
            if self.kind == "values":
                mask = mask & (x[:, None, :, :1] > -10)  # True everywhere here, but read from x
        mask = mask.expand(b, 1, s, s)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(1)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_causal_mask_made_from_sizes_becomes_is_causal(frontend):
    model, args = CausalAttention(), (torch.randn(2, 6, 16),)
    opt = graphopt.optimize(model, args, passes="normalize,dce", frontend=frontend)
    assert opt.graphopt_report.passes[0].stats["causal_masks"] == 1
    (attention,) = [n for n in opt.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert not [n for n in opt.graph.nodes if "arange" in str(n.target)]  # the mask is no longer built
    assert_same_step(model, opt, args, {}, exact=False)
    other = (torch.randn(3, 6, 16),) if frontend == "export" else (torch.randn(3, 11, 16),)
    assert_same_step(model, opt, other, {}, exact=False)  # other sizes: checked, still causal


def test_a_mask_causal_only_at_the_example_sizes_is_refused_at_others():
    model = CausalAttention("window", window=8)
    opt = graphopt.optimize(model, (torch.randn(2, 6, 16),), passes="normalize", frontend="fx")
    assert opt.graphopt_report.passes[0].stats["causal_masks"] == 1
    assert_same_step(model, opt, (torch.randn(2, 8, 16),), {}, exact=False)  # within the window: causal
    with pytest.raises(graphopt.UsageError, match="they are not causal.*Optimize the model again"):
        opt(torch.randn(2, 9, 16))  # past it the window masks keys causality keeps


@pytest.mark.parametrize("kind", ["values", "buffer"])
def test_a_mask_read_from_values_or_state_stays(kind):
    model, args = CausalAttention(kind), (torch.randn(2, 6, 16),)
    for frontend in ("fx", "export"):
        opt = graphopt.optimize(model, args, passes="normalize", frontend=frontend)
        assert opt.graphopt_report.passes[0].stats["causal_masks"] == 0
        assert_same_step(model, opt, args, {}, exact=True)
