"""Mixture-of-experts models trace: graphopt's fake torch._grouped_mm (graphopt/analysis/fake_kernels.py)
takes what the real kernel takes and gives what it gives, and only while graphopt runs."""
import pytest
import torch
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensorMode

import graphopt
from graphopt.analysis import fake_kernels
from graphopt.verification.float64_reference import grouped_mm
from graphopt.verification.verify import float64_step, outputs_and_grads

OFFS = torch.tensor([8, 8, 32], dtype=torch.int32)  # three groups, the second empty


def _layouts(dtype):
    """(name, mat_a, mat_b, offs): each layout the op takes, with output widths that are and are
    not a multiple of 16 bytes (the real kernel pads those rows), operands row- and column-major."""
    def r(*shape):
        return torch.randn(*shape).to(dtype)
    for n in (24, 5):
        yield f"2d x 3d col-major, n={n}", r(32, 16), r(3, n, 16).transpose(-2, -1), OFFS
        yield f"3d x 3d, n={n}", r(3, 32, 16), r(3, n, 16).transpose(-2, -1), None
        yield f"2d x 2d (weight gradient), n={n}", r(32, 16).t(), r(n, 32).t(), OFFS
    yield "2d x 3d row-major", r(32, 16), r(3, 16, 24), OFFS
    yield "3d x 2d", r(3, 32, 16), r(16, 32), OFFS


def _meta(t: torch.Tensor):
    return tuple(t.shape), t.stride(), t.dtype


def _fake_result(a, b, offs):
    with fake_kernels.active(), FakeTensorMode() as mode:
        fake = [None if t is None else mode.from_tensor(t) for t in (a, b, offs)]
        return _meta(torch._grouped_mm(fake[0], fake[1], offs=fake[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fake_gives_the_real_kernels_shape_dtype_and_strides(dtype):
    for name, a, b, offs in _layouts(dtype):
        assert _fake_result(a, b, offs) == _meta(torch._grouped_mm(a, b, offs=offs)), name


@pytest.mark.parametrize("a, b, offs", [
    (torch.randn(32, 16, dtype=torch.float64), torch.randn(3, 16, 8, dtype=torch.float64), OFFS),  # no float64 kernel
    (torch.randn(32, 16), torch.randn(3, 16, 8).bfloat16(), OFFS),                               # dtypes differ
    (torch.randn(32, 16), torch.randn(3, 16, 8), OFFS.long()),                                   # int64 offsets
    (torch.randn(32, 16), torch.randn(3, 16, 8), None),                                          # 2d needs offsets
    (torch.randn(32, 16), torch.randn(2, 16, 8), OFFS),                                          # 3 groups, 2 experts
    (torch.randn(32, 16), torch.randn(3, 16, 5), OFFS),                                          # row stride of 20 bytes
])
def test_the_fake_refuses_what_the_real_kernel_refuses(a, b, offs):
    with pytest.raises(RuntimeError):
        torch._grouped_mm(a, b, offs=offs)
    with pytest.raises(RuntimeError):
        _fake_result(a, b, offs)


def _torchs_own_fake_refuses_float32():
    a, b = torch.randn(32, 16), torch.randn(3, 16, 8)
    with FakeTensorMode() as mode:
        try:
            torch._grouped_mm(mode.from_tensor(a), mode.from_tensor(b), offs=mode.from_tensor(OFFS))
        except RuntimeError:
            return True
    return False


def test_the_fake_is_in_place_only_while_open_and_leaves_no_cached_result():
    assert _torchs_own_fake_refuses_float32()  # torch's fake takes bfloat16 only: what graphopt widens
    with fake_kernels.active():
        with fake_kernels.active():
            pass
        assert not _torchs_own_fake_refuses_float32()  # a nested close keeps the outer one's fake
    # the same shapes again: FakeTensorMode's cache of the widened result must not answer them
    assert _torchs_own_fake_refuses_float32()
    assert torch.ops.aten._grouped_mm.default not in fake_impls.op_implementations_dict


def _mixtral():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64, use_cache=False)
    return transformers.MixtralForCausalLM(config)


def _step(module, model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = module(ids, labels=labels).loss
    loss.backward()
    result = {"loss": loss.detach().clone(), **{n: p.grad.clone() for n, p in model.named_parameters()}}
    model.zero_grad(set_to_none=True)
    return result


def test_mixtral_optimizes_and_trains_as_eager_on_another_batch_without_widening_torch():
    model = _mixtral()
    ids = torch.randint(0, 64, (2, 16))
    opt = graphopt.optimize(model, (ids,), example_kwargs={"labels": ids})
    # under export transformers hands float32 experts to its own grouped-matmul op; graphopt's
    # FakeTensor forward before it runs the eager path, torch._grouped_mm
    assert any("grouped_mm" in str(n.target) for n in opt.graph.nodes)
    assert _torchs_own_fake_refuses_float32()  # the user's process is as it was

    generator = torch.Generator().manual_seed(1)
    other = torch.randint(0, 64, (2, 16), generator=generator)
    labels = torch.randint(0, 64, (2, 16), generator=generator).masked_fill(torch.rand(2, 16, generator=generator) < 0.3, -100)
    eager, got = _step(model, model, other, labels), _step(opt, model, other, labels)
    assert eager.keys() == got.keys()
    for name, value in eager.items():
        scale = value.abs().max().clamp_min(1e-12)
        assert float((got[name] - value).abs().max() / scale) <= 1e-5, name


def test_the_traced_expert_fallback_runs_eagers_grouped_kernel_again():
    """Under export transformers traces float32 experts into its per-expert loop; normalize gives
    the graph back the kernel eager runs: the same step on another batch, to the bit."""
    model = _mixtral()
    ids = torch.randint(0, 64, (2, 16))
    traced, opt = (graphopt.optimize(model, (ids,), example_kwargs={"labels": ids}, passes=p, frontend="export")
                   for p in ("", "normalize"))
    targets = [[str(n.target) for n in gm.graph.nodes if "grouped_mm" in str(n.target)] for gm in (traced, opt)]
    assert targets[0] and set(targets[0]) == {"transformers.grouped_mm_fallback.default"}
    assert targets[1] == ["aten._grouped_mm.default"] * len(targets[0])
    assert opt.graphopt_report.passes[0].stats["grouped_matmuls"] == len(targets[0])
    other = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    eager, got = _step(model, model, other, other), _step(opt, model, other, other)
    assert all(torch.equal(got[name], value) for name, value in eager.items())


@pytest.mark.parametrize("case", range(5))
def test_float64_reference_computes_grouped_mm_as_the_kernel_does(case):
    # the kernel has no float64: the reference step computes the groups as matmuls, checked here in float32
    name, a, b, offs = list(_layouts(torch.float32))[case]
    assert torch.allclose(grouped_mm(a, b, offs), torch._grouped_mm(a, b, offs), rtol=1e-5, atol=1e-5), name


def test_a_float64_step_of_an_moe_model_runs_and_is_what_float32_rounds():
    model = _mixtral()
    ids = torch.randint(0, 64, (2, 16))
    with pytest.raises(RuntimeError):  # torch's own float64 step: no float64 kernel
        model.double()(ids, labels=ids).loss.backward()
    model.float().zero_grad(set_to_none=True)
    single = outputs_and_grads(model, (ids,), {"labels": ids}, train=True, seed=0)
    double = float64_step(model, (ids,), {"labels": ids}, train=True, seed=0)
    assert single.keys() == double.keys() and next(model.parameters()).dtype == torch.float32
    # transformers' loss upcasts logits with .float(): the loss itself comes back float32
    assert all(value.dtype == torch.float64 for name, value in double.items() if name.startswith("grad"))
    for name, value in double.items():
        scale = value.abs().max().clamp_min(1e-12)
        assert float((single[name].double() - value).abs().max() / scale) <= 1e-4, name


# two planned steps measured (23 s): make test-real; the corpus's MoE memory promise runs there too
@pytest.mark.slow
def test_a_budget_plan_holds_for_every_routing():
    """The grouped experts' shapes are the batch's (tokens x experts per token rows, sorted by
    expert): the router decides only values, so the step's memory is the same for any routing,
    every token to the same two experts included."""
    from graphopt.analysis.memory import GB
    from graphopt.runtime.step import step_peak

    model = _mixtral()
    ids = torch.randint(0, 64, (32, 16))
    eager = step_peak(model, model, (ids,), {"labels": ids})
    opt = graphopt.optimize(model, (ids,), example_kwargs={"labels": ids}, budget_gb=0.85 * eager / GB)
    assert opt.graphopt_report.passes[-1].stats["segments"] > 0
    routers = [m.gate if hasattr(m, "gate") else m.router for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    peaks = {"as drawn": step_peak(opt, model, (ids,), {"labels": ids})}
    with torch.no_grad():
        for router in routers:
            router.weight.zero_()  # equal logits: top-k gives every token the same two experts
    peaks["all to two experts"] = step_peak(opt, model, (ids,), {"labels": ids})
    assert peaks["as drawn"] == peaks["all to two experts"] <= 0.85 * eager, peaks


def test_experts_looped_by_routing_are_refused_with_the_grouped_form_named():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, use_cache=False, experts_implementation="eager")
    ids = torch.randint(0, 64, (2, 16))
    with pytest.raises(graphopt.TraceError, match="shapes depend on tensor values.*experts_implementation='grouped_mm'"):
        graphopt.optimize(transformers.MixtralForCausalLM(config), (ids,), example_kwargs={"labels": ids})
