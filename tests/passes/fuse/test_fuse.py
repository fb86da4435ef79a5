"""The fuse pass: which nodes group together and why others stay out, on hand-written graphs; whole
models with fusion on (equal loss and gradients, fewer kernels per step); the kernels in the dumps."""
import math
import operator

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_step, step
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphopt
from graphopt.passes.notes import notes
from graphopt.runtime import FusedOp, launch_count, running_fused
from graphopt.runtime.chunked_loss import ChunkedHeadLoss
from graphopt.runtime.fused_row import FusedRowOp
from graphopt.testing import zoo

pytest.importorskip("triton")
# the interpreter evaluates masked-off lanes too: numpy warns, the stores are masked
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    """Fused groups run their generated Triton kernels, in Triton's interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# fx traces a forward with named parameters: one per arity, named x, y, z
FORWARDS = {1: lambda self, x: self.fn(self, x), 2: lambda self, x, y: self.fn(self, x, y),
            3: lambda self, x, y, z: self.fn(self, x, y, z)}


class Fn(nn.Module):
    """fn(module, *inputs) as a module; keyword modules become its submodules."""

    def __init__(self, fn, **modules):
        super().__init__()
        self.fn = fn
        for name, m in modules.items():
            setattr(self, name, m)


def module(fn, arity, **modules):
    return type("Fn", (Fn,), {"forward": FORWARDS[arity]})(fn, **modules)


def fuse(fn, *args, train=True, **modules):
    """The model, its fused GraphModule (checked against eager by the pass manager) and the pass's stats."""
    model = module(fn, len(args), **modules)
    opt = graphopt.optimize(model, args, passes="fuse", train=train, verify=True)
    return model, opt, opt.graphopt_report.passes[-1].stats


def fused_nodes(gm):
    """The calls running a fused group: its own, or a loss's with its linear head (ChunkedHeadLoss)."""
    return [n for n in gm.graph.nodes if isinstance(n.target, (FusedOp, FusedRowOp, ChunkedHeadLoss))]


def group_nodes(stats):
    return [g["nodes"] for g in stats["groups"]]


def leaves(*shapes):
    return [torch.randn(*s, requires_grad=True) for s in shapes]


def test_a_chain_with_a_broadcast_bias_and_scalars_is_one_kernel():
    x, b = leaves((4, 8), (8,))
    model, opt, stats = fuse(lambda m, x, b: F.silu(F.gelu(x * 2.0 + b) - 0.5), x, b)
    assert group_nodes(stats) == [["mul", "add", "gelu", "sub", "silu"]]
    (call,) = fused_nodes(opt)
    assert [a.name for a in call.args] == ["x", "y"]
    assert notes(call)["fuse"] == "group 0"
    # eager reads and writes 4x8 floats per op (and the bias once); the kernel reads x, b and writes once
    assert stats["groups"][0]["bytes_saved"] == (2 * 5 * 128 + 32) - (128 + 32 + 128)
    assert_same_step(model, opt, (x, b), {}, exact=False)


def test_fan_out_stays_inside_and_an_intermediate_used_outside_becomes_an_output():
    x, w = leaves((4, 8), (8, 8))

    def fn(m, x, w):
        y = torch.sigmoid(x)
        z = (y * 2.0) * (y + 1.0)  # y fans out inside the group
        return z.tanh(), y @ w  # y is also read by the matmul
    model, opt, stats = fuse(fn, x, w)
    (group,) = stats["groups"]
    assert group["nodes"] == ["sigmoid", "mul", "add", "mul_1", "tanh"]
    assert group["outputs"] == ["sigmoid", "tanh"]
    (call,) = fused_nodes(opt)
    assert [u.target for u in call.users] == [operator.getitem] * 2
    assert_same_step(model, opt, (x, w), {}, exact=False)


def test_a_group_never_closes_a_cycle_through_an_outside_node():
    """relu -> matmul -> add: relu and add in one kernel would need the matmul inside it."""
    x, w = leaves((4, 8), (8, 8))

    def fn(m, x, w):
        a = (x * 2.0).relu()
        return (a + a @ w).tanh()
    model, opt, stats = fuse(fn, x, w)
    assert group_nodes(stats) == [["mul", "relu"], ["add", "tanh"]]
    reasons = stats["groups"][0]["not_fused"]
    assert reasons["add"] == "would create a cycle (path relu -> matmul -> add)"
    assert reasons["matmul"] == "not elementwise (matmul)"
    assert_same_step(model, opt, (x, w), {}, exact=False)


def test_legality_says_why_not_in_kinds_code_can_read():
    """can_merge answers with a WhyNot: a kind for code, the text the report shows."""
    from graphopt.passes.fuse.fusion import WhyNot, _merge, candidates

    def fn(m, x, w):
        a = (x * 2.0).relu()
        return (a + a @ w).tanh()
    x, w = leaves((4, 8), (8, 8))
    gm = graphopt.trace(module(fn, 2), (x, w))
    _, refused = _merge(gm, candidates(gm)[0])
    cycles = [why for why in refused.values() if why.kind == "cycle"]
    assert cycles and all(isinstance(why, WhyNot) and str(why).startswith("would create a cycle") for why in cycles)


def test_single_ops_are_left_alone():
    x, w = leaves((4, 8), (8, 8))
    _, opt, stats = fuse(lambda m, x, w: torch.relu(x @ w) @ w, x, w)
    assert stats["kernels"] == 0 and not fused_nodes(opt)
    assert not opt.graphopt_report.passes[-1].changed


def sinusoidal(m, t):
    """diffusers' timestep embedding: a frequency table from arange, times steps in the thousands."""
    freqs = torch.exp(-math.log(10000.0) * torch.arange(64, dtype=torch.float32) / 64)
    angles = t[:, None].float() * freqs[None]
    return m.proj(torch.cat([angles.sin(), angles.cos()], dim=-1)).square().mean()


def test_a_table_computed_from_no_input_stays_eager_and_the_step_follows_eager():
    """torch.export keeps the table's arange and exp as nodes (fx folds them into a constant)."""
    from graphopt.passes.fuse.fusion import candidates
    t = torch.rand(4) * 1000
    model = module(sinusoidal, 1, proj=nn.Linear(128, 8))
    opt = graphopt.optimize(model, (t,), passes="fuse", frontend="export")
    groups = [g["ops"] for g in opt.graphopt_report.passes[-1].stats["groups"]]
    assert ["mul", "sin", "cos"] in [ops[-3:] for ops in groups] and not any("exp" in ops for ops in groups)
    gm = graphopt.trace(model, (t,), frontend="export")
    why = {n.name: why for n, why in candidates(gm)[1].items()}
    assert why["exp"].startswith("computed from no input of the graph"), why
    for steps in (t, torch.rand(4) * 1000):  # the example and a second batch
        assert_same_step(model, opt, (steps,), {}, exact=False)


def residual_dropout(m, x, y):
    return m.drop(F.gelu(x)) * 0.5 + y


def test_dropout_joins_the_group_in_training():
    x, y = leaves((4, 8), (4, 8))
    model, opt, stats = fuse(residual_dropout, x, y, drop=nn.Dropout(0.5))
    assert group_nodes(stats) == [["gelu", "drop", "mul", "add"]]
    assert_same_step(model, opt, (x, y), {}, exact=False)  # the call draws eager's mask (test_fuse_dropout.py)


def test_dropout_in_inference_is_an_identity_inside_the_group():
    x, y = leaves((4, 8), (4, 8))
    model, opt, stats = fuse(residual_dropout, x, y, train=False, drop=nn.Dropout(0.5))
    (group,) = stats["groups"]
    assert group["nodes"] == ["gelu", "drop", "mul", "add"]
    assert group["ops"] == ["gelu", "mul", "add"]  # the dropout computes nothing
    assert not [n for n in opt.graph.nodes if n.op == "call_module"]
    assert_same_step(model, opt, (x, y), {}, exact=False)


def test_an_identity_dropout_of_an_input_used_outside_is_that_input():
    x = leaves((4, 8))[0]

    def fn(m, x):
        d = m.drop(x)
        return d, (d * 2.0).exp()
    model, opt, stats = fuse(fn, x, train=False, drop=nn.Dropout(0.5))
    (group,) = stats["groups"]
    assert group["nodes"] == ["drop", "mul", "exp"] and group["outputs"] == ["exp"]
    output = next(n for n in opt.graph.nodes if n.op == "output")
    assert output.args[0][0].name == "x"  # eager returns x itself too
    assert_same_step(model, opt, (x,), {}, exact=False)


def test_random_and_state_writing_ops_are_refused():
    x = leaves((4, 8))[0]

    def fn(m, x):
        noisy = (torch.rand_like(x) + x).exp()
        y = x.sigmoid() * 2.0
        y.add_(1.0)
        return noisy, y
    model, opt, stats = fuse(fn, x)
    reasons = {k: v for g in stats["groups"] for k, v in g["not_fused"].items()}
    assert reasons["rand_like"] == "random (rand_like draws from the RNG)"
    assert reasons["add_"] == "add_ writes state"
    assert group_nodes(stats) == [["add", "exp"], ["sigmoid", "mul"]]
    torch.manual_seed(0)
    want = model(x)
    torch.manual_seed(0)
    for got, expected in zip(opt(x), want):
        torch.testing.assert_close(got, expected)


def test_no_read_moves_past_a_write_and_no_alias_becomes_a_copy():
    x = leaves((4, 8))[0]

    def fn(m, x):
        y = x.detach().clone()
        a = x.exp().sin()
        y.add_(1.0)  # a kernel reading y across this line would read it at one point; x is no view of y
        d = m.drop(a * 2.0)  # an eval dropout returns its input itself ...
        d.mul_(3.0)  # ... so this writes a * 2.0 too: a fused copy would not be written
        return (a * y).cos(), d
    model, opt, stats = fuse(fn, x, train=False, drop=nn.Dropout(0.1))
    assert group_nodes(stats) == [["exp", "sin", "mul"], ["mul_1", "cos"]]
    assert stats["groups"][0]["not_fused"] == {"mul_1": "add_ may write memory between them",
                                               "drop": "it may return its input itself, and mul_ may write mul"}
    for got, expected in zip(opt(x), model(x)):
        torch.testing.assert_close(got, expected)


def test_ops_codegen_declines_stay_out_with_its_reason():
    x = leaves((4, 8))[0]
    _, _, stats = fuse(lambda m, x: ((x * 2.0).relu().double() * 3.0).sum(), x)
    assert group_nodes(stats) == [["mul", "relu"]]
    reasons = stats["groups"][0]["not_fused"]
    assert reasons["double"].startswith("declined by codegen: step 0 casts to float64")


def test_groups_that_cannot_be_placed_or_are_dead_are_reported_and_left_alone():
    x, y, w = leaves((4, 8), (4, 8), (8, 8))

    def fn(m, x, y, w):
        a = x + 1.0
        total = a.sum()  # uses the group's result ...
        v = y @ w  # ... before this input of the group is computed
        (y * 2.0).exp()  # dead: fx keeps it, and only dce would remove it
        return total, a * v
    _, opt, stats = fuse(fn, x, y, w)
    assert stats["kernels"] == 0 and not fused_nodes(opt)
    declined = {tuple(d["nodes"]): d["reason"] for d in stats["declined"]}
    assert declined[("add", "mul_1")] == ("sum_1 uses the group's result before its input matmul is computed; "
                                          "fusing would need the graph reordered")
    assert declined[("mul", "exp")] == "dead code: nothing outside the group uses its results"


def test_kernels_and_the_fusion_report_go_to_the_dumps(tmp_path):
    x, b = leaves((4, 8), (8,))
    model = module(lambda m, x, b: torch.tanh(x + b) * 2.0, 2)
    opt = graphopt.optimize(model, (x, b), passes="fuse", dump_dir=tmp_path)
    (call,) = fused_nodes(opt)
    kernel = (tmp_path / "kernels" / f"{call.name}.py").read_text()
    assert kernel.startswith(f"# {call.name}: add -> tanh -> mul\n# FX nodes: add, tanh, mul\n")
    assert "def fused_forward(" in kernel and "def fused_backward(" in kernel
    assert "def main():" in (tmp_path / "kernels" / f"{call.name}_repro.py").read_text()
    report = next(tmp_path.glob("*-fuse.fusion.md")).read_text()
    assert "add -> tanh -> mul" in report
    assert "fuse=group 0" in next(tmp_path.glob("*-fuse.txt")).read_text()


# ---------------------------------------------------------------- whole models


class CountLaunches(TorchDispatchMode):
    """ATen ops that run a kernel (views do not), with each fused group's run counted once."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not running_fused() and not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def launches_per_step(module, args, kwargs) -> int:
    before = launch_count()
    with CountLaunches() as mode:
        step(module, args, kwargs)
    return mode.ops + launch_count() - before


MODELS = {"mlp": (zoo.mlp, "auto"), "llama": (zoo.llama, "fx"), "hf_gpt2": (zoo.hf_gpt2, "export")}


@pytest.mark.parametrize("name", MODELS)
def test_models_train_the_same_with_fewer_kernels(name):
    build, frontend = MODELS[name]
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    model, args, kwargs = build()
    plain, opt = (graphopt.optimize(model, args, example_kwargs=kwargs, passes=passes, train=True, frontend=frontend)
                  for passes in ("normalize,cse,dce", "normalize,cse,dce,fuse"))
    stats = opt.graphopt_report.passes[-1].stats
    assert stats["kernels"] >= 1 and len(fused_nodes(opt)) == stats["kernels"]
    assert_same_step(model, opt, args, kwargs, exact=False, tol=1e-5)
    # against the same graph unfused too: an exported graph does not run eager's ops one for one
    fused = launches_per_step(opt, args, kwargs)
    assert fused < launches_per_step(plain, args, kwargs) and fused < launches_per_step(model, args, kwargs)


@pytest.mark.parametrize("train", [True, False])
def test_the_zoo_gpt_fuses_each_residual_add_into_the_layer_norm_after_it(train):
    """Each residual add sits between a linear and a layer norm: it joins the norm in a row kernel;
    the loss is a row kernel too, and in training so are the dropouts before each add (the call
    draws their masks; in eval they are gone). Its GELU sits between two linears: it takes over
    the first one's bias add."""
    model, args, kwargs = zoo.gpt()
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, passes="normalize,cse,dce,fuse", train=train)
    stats = opt.graphopt_report.passes[-1].stats
    assert stats["kernels"] == len(fused_nodes(opt)) == 8
    # the embeddings' sum (position embeddings broadcast over the batch) joins the first norm
    if train:
        expected = [["add", "drop", "blocks_0_ln1"], ["blocks_0_proj", "dropout", "add_1", "blocks_0_ln2"],
                    ["blocks_0_fc", "gelu"], ["blocks_0_out", "dropout_1", "add_2", "blocks_1_ln1"],
                    ["blocks_1_proj", "dropout_2", "add_3", "blocks_1_ln2"], ["blocks_1_fc", "gelu_1"],
                    ["blocks_1_out", "dropout_3", "add_4", "ln"]]
    else:
        expected = [["add", "blocks_0_ln1"], ["add_1", "blocks_0_ln2"], ["blocks_0_fc", "gelu"],
                    ["add_2", "blocks_1_ln1"], ["add_3", "blocks_1_ln2"], ["blocks_1_fc", "gelu_1"], ["add_4", "ln"]]
    assert group_nodes(stats) == expected + [["cross_entropy"]]
    assert all(isinstance(n.target, FusedRowOp) for n in fused_nodes(opt))
    # 256 classes: run with the head over chunks, the loss would spare too little (passes/fuse/head_loss.py)
    assert "would peak no lower" in next(iter(stats["heads_not_chunked"].values()))
    # in eval the second linear's bias would join only the residual add, which passes its gradient through
    assert stats["groups"][2]["not_fused"]["blocks_0_out"] == (
        "blocks_0_out's matmul reads it, and runs before the kernel that adds its bias" if train
        else "its bias add would join only add, which passes the gradient through: it stays in the matmul")
    assert_same_step(model, opt, args, kwargs, exact=False, tol=1e-5)


def test_a_fused_group_keeps_for_backward_only_the_inputs_its_backward_reads():
    """drop-path's x * mask + residual: the gradient of x reads the mask, nothing reads x or the
    residual (the mask wants no gradient): the call saves the mask alone (the others' shapes are
    its bound call's), where it kept all three."""
    def fn(m, x, mask):
        h = m.a(x)
        return m.b(h * mask + x).sum()

    model = module(fn, 2, a=nn.Linear(32, 32, bias=False), b=nn.Linear(32, 32))
    args = (torch.randn(16, 32), (torch.rand(16, 1) > 0.5).float())
    opt = graphopt.optimize(model, args, passes="fuse")
    assert len(fused_nodes(opt)) == 1
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = opt(*args)
    fused_saves = [t for t in saved if t.device.type == "meta" or tuple(t.shape) == (16, 1)]
    assert [(t.device.type, tuple(t.shape)) for t in fused_saves] == [("cpu", (16, 1))]
    loss.backward()
    assert_same_step(model, opt, args, {}, exact=False)
