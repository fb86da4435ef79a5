import copy
import sys

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.errors import TraceError
from graphopt.analysis.meta import TensorInfo, tensor_info
from graphopt.runtime.guards import refusal
from graphopt.testing import zoo

from conftest import FX_ZOO


def _assert_complete(gm):
    """Every node that makes a tensor carries its TensorInfo with consistent fields."""
    seen = 0
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        info = tensor_info(node)
        if isinstance(val, torch.Tensor):
            assert isinstance(info, TensorInfo), node.format_node()
            assert info.shape == tuple(val.shape) and info.dtype == val.dtype and info.device == val.device
            assert info.stride == tuple(val.stride())
            assert info.nbytes == val.numel() * val.element_size()
            seen += 1
        elif node.op in ("call_function", "call_method", "call_module", "placeholder", "get_attr"):
            assert not isinstance(info, TensorInfo), node.format_node()
    assert seen > 0


@pytest.mark.parametrize("name", FX_ZOO)
def test_zoo_traces_with_fx(name):
    model, args, kwargs = FX_ZOO[name]()
    gm = graphopt.trace(model, args, kwargs, frontend="fx")
    assert gm.meta["graphopt_frontend"] == "fx"
    _assert_complete(gm)


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_bert"])
def test_transformers_models_trace_with_export(name):
    pytest.importorskip("transformers")
    model, args, kwargs = zoo.HF_ZOO[name]()
    with pytest.raises(graphopt.TraceError, match="fx"):
        graphopt.trace(model, args, kwargs, frontend="fx")
    gm = graphopt.trace(model, args, kwargs)  # auto falls back to export
    assert gm.meta["graphopt_frontend"] == "export"
    _assert_complete(gm)
    assert any("scaled_dot_product_attention" in str(n.target) for n in gm.graph.nodes)


def test_gpt_traces_with_export_too():
    model, args, kwargs = zoo.gpt()
    gm = graphopt.trace(model, args, kwargs, frontend="export")
    _assert_complete(gm)


def test_source_locations_recorded():
    model, args, kwargs = zoo.gpt()
    gm = graphopt.trace(model, args, kwargs, frontend="fx")
    traced = [n for n in gm.graph.nodes if n.op == "call_function" and n.stack_trace]
    assert traced and any("zoo.py" in n.stack_trace for n in traced)


def test_tracing_allocates_nothing_and_touches_no_buffer():
    model, args, kwargs = zoo.convnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graphopt.trace(model, args, kwargs)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_ten_gigabyte_model_traces_on_meta_device():
    with torch.device("meta"):
        big = nn.Sequential(*[nn.Linear(16384, 16384) for _ in range(10)])
    assert sum(p.numel() * 4 for p in big.parameters()) > 10e9
    gm = graphopt.trace(big, (torch.empty(8, 16384, device="meta"),))
    out = [n for n in gm.graph.nodes if n.op == "call_module"][-1]
    assert tensor_info(out).shape == (8, 16384)


def test_shares_parameters_and_state_dict_keys():
    model, args, kwargs = zoo.gpt()
    gm = graphopt.trace(model, args, kwargs)
    assert list(gm.state_dict()) == list(model.state_dict())
    params = dict(model.named_parameters())
    for name, p in gm.named_parameters():
        assert p is params[name]


class Tied(nn.Module):
    """One Parameter under two names (a language model's tied embedding and head), and a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        h = torch.nn.functional.linear(x, self.embed.weight) * self.scale
        return torch.nn.functional.linear(h, self.head.weight) + self.scale


def test_parameters_and_buffers_read_in_forward_are_named_as_torch_names_them():
    # graphopt's tracer finds a tensor's name by identity rather than scanning every parameter
    # and buffer per read: the graph reads them under the names torch's own tracer gives
    class Scanning(torch.fx.Tracer):  # torch's own getattr, buffers read as graphopt's tracer reads them
        proxy_buffer_attributes = True

    model = Tied()
    ours, theirs = graphopt.trace(model, (torch.randn(2, 4),), frontend="fx"), Scanning().trace(model)
    targets = lambda graph: [n.target for n in graph.nodes if n.op == "get_attr"]  # noqa: E731
    assert targets(ours.graph) == targets(theirs) == ["embed.weight", "scale"]
    # a parameter's node comes from the model's line that reads it, not from graphopt's tracer
    weight = next(n for n in ours.graph.nodes if n.op == "get_attr")
    tracer_file = sys.modules["graphopt.frontend.trace"].__file__
    assert "self.embed.weight" in weight.meta["stack_trace"] and tracer_file not in weight.meta["stack_trace"]
    x = torch.randn(5, 4)  # a second batch, of other rows
    assert torch.equal(ours(x), model(x))


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # value-dependent control flow: no frontend can capture it
            return x * 2
        return x - 1


def test_untraceable_model_raises_trace_error_with_each_reason():
    with pytest.raises(graphopt.TraceError) as info:
        graphopt.trace(DataDependent(), (torch.randn(4),))
    err = info.value
    assert set(err.reasons) == {"fx", "export"}
    assert "What you can do" in str(err)


def test_bad_inputs_are_usage_errors():
    model, args, _ = zoo.mlp()
    with pytest.raises(graphopt.UsageError, match="nn.Module"):
        graphopt.trace(lambda x: x, args)
    with pytest.raises(graphopt.UsageError, match="tuple"):
        graphopt.trace(model, {"x": args[0]})
    with pytest.raises(graphopt.UsageError, match="signature|do not fit"):
        graphopt.trace(model, (args[0], args[0]))
    with pytest.raises(graphopt.TraceError, match="example"):
        graphopt.trace(model, (torch.randn(3, 5),))  # wrong width for the first Linear
    with pytest.raises(graphopt.OptionError, match="auto, fx, export"):
        graphopt.trace(model, args, frontend="dynamo")


class _BranchesOnItsBatch(torch.nn.Module):
    def __init__(self, branch):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.branch = branch

    def forward(self, x):
        if self.branch(x.shape[0]):
            return self.linear(x) * 2
        return self.linear(x)


def test_an_export_graph_runs_at_any_batch_size_and_length_export_proved():
    pytest.importorskip("transformers")
    model, (ids,), kwargs = zoo.hf_bert(batch=4)
    opt = graphopt.optimize(model, (ids,), example_kwargs=kwargs)
    assert opt.meta["graphopt_frontend"] == "export"
    # the attention mask's length is the ids' (export proved them one size): one name for both
    assert opt.graphopt_report.runs_at == ("batch 2 and up; dim 1 of argument 1: 2 to 64 (torch.export, dynamic sizes); "
                                           "at a batch size it does not take, a graph built for it at its first call")
    for rows, length in ((2, 16), (8, 16), (4, 8), (2, 40)):
        other = ids.repeat(2, 3)[:rows, :length]
        more = {k: v.repeat(2, 3)[:rows, :length] for k, v in kwargs.items()}
        torch.manual_seed(0)  # dropout draws the same masks
        want = model(other, **more).last_hidden_state
        torch.manual_seed(0)
        got = opt(other, **more).last_hidden_state
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    # beyond the position table, and lengths the inputs disagree on
    with pytest.raises(graphopt.UsageError, match=r"dim 1 of argument 1 is 80 \(it takes 2 to 64\)"):
        opt(ids.repeat(1, 5), **{k: v.repeat(1, 5) for k, v in kwargs.items()})
    with pytest.raises(graphopt.UsageError, match="dim 1 of argument 1 is 8 in one input and 12 in another"):
        opt(ids[:, :8], **{k: v[:, :12] for k, v in kwargs.items()})


@pytest.mark.parametrize("branch, proved, refused", [
    (lambda rows: rows == 1, "batch 2 and up", 1),  # export proves nothing for batches of 0 and 1
    (lambda rows: rows > 3, "batch 4 and up", 3),
    (lambda rows: rows < 6, "batch 2 to 5", 6),
    (lambda rows: rows % 2 == 0, "batch 2 and up", 3),  # no range says "even": export's own check does
])
def test_an_export_graph_keeps_to_the_batch_sizes_export_proved(branch, proved, refused):
    model, x = _BranchesOnItsBatch(branch), torch.randn(4, 8)
    opt = graphopt.optimize(model, (x,), frontend="export")
    assert str(opt.meta["graphopt_batch"]) == proved
    for rows in (2, 4):
        if branch(rows) == branch(4):
            assert torch.equal(opt(torch.ones(rows, 8)), model(torch.ones(rows, 8)))
    assert not opt.graphopt_batch_graphs.graphs
    assert "torch.export traced it so" in str(refusal(opt, (torch.ones(refused, 8),), {}))  # the graph itself
    # called, it runs on a graph built for that batch, which takes the other branch as eager does
    assert torch.equal(opt(torch.ones(refused, 8)), model(torch.ones(refused, 8)))
    assert list(opt.graphopt_batch_graphs.graphs) == [refused]


def test_a_batch_the_model_depends_on_or_of_one_row_stays_static():
    model, x = _BranchesOnItsBatch(lambda rows: rows == 4), torch.randn(4, 8)
    opt = graphopt.optimize(model, (x,), frontend="export")
    assert opt.meta["graphopt_batch"] is None and "depends on its size" in opt.graphopt_report.runs_at
    one = graphopt.optimize(model, (x[:1],), frontend="export")  # an example of one row shows no batch
    assert one.meta["graphopt_batch"] is None and "one row" in one.graphopt_report.runs_at
    assert torch.equal(one(x[:1]), model(x[:1]))
    assert isinstance(refusal(one, (x,), {}), graphopt.UsageError)
    assert torch.equal(one(x), model(x))  # on a graph built for 4 rows
    assert list(one.graphopt_batch_graphs.graphs) == [4]


class CachingAttention(nn.Module):
    """timm LeViT's pattern: in eval mode, biases computed once per device and kept in a dict."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 8))
        self.cache = {}

    def biases(self, device):
        key = str(device)
        if self.training:
            return self.table * 2.0
        if key not in self.cache:
            self.cache[key] = self.table * 2.0
        return self.cache[key]

    def forward(self, x):
        return x @ self.biases(x.device).t()


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_tracing_leaves_a_modules_cache_as_it_found_it(frontend):
    model = CachingAttention().eval()
    x = torch.randn(3, 8)
    try:
        graphopt.trace(model, (x,), frontend=frontend)
    except TraceError:  # torch.export refuses a tensor made at trace time and kept: fx takes the model
        assert frontend == "export"
    assert model.cache == {}  # no Proxy, no FakeTensor left in it
    copy.deepcopy(model)
    torch.testing.assert_close(model(x), x @ (model.table * 2.0).t())


class BranchesOnValues(torch.nn.Module):
    """Python that reads an input's values: an all-ones mask takes a shortcut, as padding checks do."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, mask):
        if mask.all():
            return self.lin(x).sum()
        return (self.lin(x) * mask[..., None]).sum()


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_branch_on_an_inputs_values_is_refused_not_taken_for_every_batch(frontend):
    # traced on an all-ones mask, a graph of the shortcut alone would be wrong on a padded batch
    with pytest.raises(graphopt.TraceError, match=frontend):
        graphopt.trace(BranchesOnValues(), (torch.randn(2, 3, 4), torch.ones(2, 3)), frontend=frontend)
