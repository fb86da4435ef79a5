import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.analysis.meta import TensorInfo, tensor_info
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
