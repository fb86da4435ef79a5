"""The fuse pass with reductions over the last dim: norms, softmaxes and row sums join the elementwise
ops around them in row kernels (Triton's interpreter), equal to eager forward and backward; what
stays out says why; the CPU path, FakeTensors and the memory a fused norm saves."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_step, measured_step_peak, plain_and_fused_peaks
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fuse import fused_nodes, group_nodes, leaves, module

import graphopt
from graphopt.analysis.memory import estimate_peak
from graphopt.runtime.chunked_loss import ChunkedHeadLoss
from graphopt.runtime.fused_row import FusedRowOp
from graphopt.testing import zoo
from graphopt.frontend.graph_inputs import placeholder_values
from hypothesis_profiles import examples

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked-off lanes: log(0)


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def fuse(fn, *args, **modules):
    model = module(fn, len(args), **modules)
    opt = graphopt.optimize(model, args, passes="fuse")
    assert_same_step(model, opt, args, {}, exact=False)
    return opt, opt.graphopt_report.passes[-1].stats


def hf_rms_norm(m, x):
    """transformers' LlamaRMSNorm, spelled as it is."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return m.weight * (x * torch.rsqrt(variance + 1e-6))


def test_hf_rms_norm_is_one_row_kernel():
    opt, stats = fuse(hf_rms_norm, torch.randn(2, 5, 48, requires_grad=True), weight=torch.nn.Parameter(torch.randn(48)))
    assert stats["kernels"] == 1 and isinstance(fused_nodes(opt)[0].target, FusedRowOp)
    assert stats["groups"][0]["ops"] == ["pow_scalar", "row_sum", "mul", "add", "rsqrt", "mul", "mul"]


def test_a_row_kernel_s_programs_and_text_are_built_once_not_per_call(monkeypatch):
    from graphopt.codegen import row_launch, row_program

    opt, _ = fuse(hf_rms_norm, torch.randn(2, 5, 48, requires_grad=True), weight=torch.nn.Parameter(torch.randn(48)))
    x = torch.randn(2, 5, 48, requires_grad=True)
    opt(x).sum().backward()
    built = []
    for module_, name in ((row_program, "_forward_program"), (row_program, "_backward_program"),
                          (row_launch, "source")):
        real = getattr(module_, name)
        monkeypatch.setattr(module_, name, lambda *a, real=real, name=name, **k: built.append(name) or real(*a, **k))
    opt(x).sum().backward()
    assert built == []


def test_residual_add_joins_a_layer_norm_module_and_its_parameters_are_read_once():
    ln = torch.nn.LayerNorm(40)
    torch.nn.init.normal_(ln.weight), torch.nn.init.normal_(ln.bias)
    opt, stats = fuse(lambda m, x, y: m.ln(x + y), torch.randn(3, 40, requires_grad=True), torch.randn(3, 40), ln=ln)
    assert group_nodes(stats) == [["add", "ln"]]
    reads = [n.target for n in opt.graph.nodes if n.op == "get_attr"]
    assert reads == ["ln.weight", "ln.bias"]


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_scaled_scores_a_mask_broadcast_over_heads_and_their_softmax_are_one_kernel(name):
    normalize = getattr(F, name)

    def attention_probs(m, q, k, mask):
        scores = (q @ k.transpose(-1, -2)) * 0.125
        return normalize(scores + mask, dim=-1).exp()

    q, k = torch.randn(2, 3, 6, 8, requires_grad=True), torch.randn(2, 3, 6, 8, requires_grad=True)
    mask = torch.zeros(2, 1, 6, 6).masked_fill(torch.rand(2, 1, 6, 6) < 0.3, -1e4)
    opt, stats = fuse(attention_probs, q, k, mask)
    (probs,) = stats["groups"]
    assert probs["nodes"] == ["mul", "add", name, "exp"] and probs["inputs"] == ["matmul", "z"]


def test_a_transposed_value_joins_a_row_group_and_is_written_as_eager_lays_it_out():
    """q.transpose(1, 2) * 2 is not contiguous: no elementwise group takes it (they write contiguous
    tensors), a row group does, in eager's layout."""
    def fn(m, x):
        q = x.transpose(1, 2) * 2.0
        return q + q.amax(-1, keepdim=True), q

    x = torch.randn(2, 5, 3, 8, requires_grad=True)
    opt, stats = fuse(fn, x)
    assert group_nodes(stats) == [["transpose", "mul", "amax", "add"]] or group_nodes(stats) == [["mul", "amax", "add"]]
    got, want = opt(x), fn(None, x)
    assert [t.stride() for t in got] == [t.stride() for t in want]


def test_a_transposed_elementwise_chain_runs_over_its_layout_and_is_written_where_eager_keeps_it():
    """No elementwise kernel writes eager's layout; a row group over it does (columns along the
    innermost dim in memory, here dim 0 of the transposed value)."""
    x = torch.randn(4, 6, requires_grad=True)
    opt, stats = fuse(lambda m, x: (x.transpose(0, 1) * 2).exp(), x)
    assert group_nodes(stats) == [["mul", "exp"]] and isinstance(fused_nodes(opt)[0].target, FusedRowOp)
    assert opt(x).stride() == (x.transpose(0, 1) * 2).exp().stride() == (1, 6)


def test_a_transposed_half_precision_chain_says_why_it_stays_out():
    model = module(lambda m, x: (x.transpose(0, 1) * 2).exp(), 1)
    opt = graphopt.optimize(model, (torch.randn(4, 6, dtype=torch.float16),), passes="fuse")
    stats = opt.graphopt_report.passes[-1].stats
    assert stats["kernels"] == 0
    assert "an elementwise kernel writes contiguous tensors" in stats["alone"]["mul"]["exp"]


def test_row_sums_and_maxima_with_keepdim_join_and_other_reductions_say_why_not():
    def fn(m, x):
        a = x - x.amax(-1, keepdim=True)
        b = a.exp().sum(-1, keepdim=True)
        return a / b + x.sum(0)  # a sum over dim 0 is no row reduction

    opt, stats = fuse(fn, torch.randn(4, 33, requires_grad=True))
    (group,) = stats["groups"]
    assert group["ops"][:5] == ["row_max", "sub", "exp", "row_sum", "div"]
    assert "reduce the last dim" in group["not_fused"]["sum_2"]


def hf_rms_norm_half(m, x):
    """transformers' LlamaRMSNorm in bf16: its statistics in float32, the result cast back."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return m.weight * h.to(torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float16)


def scaled_softmax_half(m, s, mask):
    """transformers' eager attention: scores scaled and masked, softmax in float32, cast back."""
    return F.softmax(s * 0.125 + mask, -1, dtype=torch.float32).to(s.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["rms_norm", "layer_norm", "softmax", "reductions"])
def test_half_precision_rows_are_one_kernel_rounding_as_eager(case, dtype):
    """Each value is rounded where eager's op rounds it (a norm's or softmax's once, at its end;
    float32 inside); the step is no further from float64 than eager's in that dtype."""
    def randn(*shape, grad=False):
        return torch.randn(*shape, dtype=dtype).requires_grad_(grad)

    if case == "rms_norm":
        fn, args, mods = hf_rms_norm_half, (randn(3, 5, 48, grad=True),), {"weight": torch.nn.Parameter(randn(48))}
    elif case == "layer_norm":
        ln = torch.nn.LayerNorm(48).to(dtype)
        fn, args, mods = (lambda m, x, y: m.ln(x + y)), (randn(4, 48, grad=True), randn(4, 48)), {"ln": ln}
    elif case == "softmax":
        fn, args, mods = scaled_softmax_half, (randn(2, 3, 8, 8, grad=True), randn(2, 1, 8, 8)), {}
    else:
        fn, args, mods = (lambda m, x: x.amax(-1, keepdim=True) * x.mean(-1, keepdim=True) + x.softmax(-1)), \
            (randn(4, 40, grad=True),), {}
    model = module(fn, len(args))
    for name, value in mods.items():
        setattr(model, name, value)
    opt = graphopt.optimize(model, args, passes="fuse")
    stats = opt.graphopt_report.passes[-1].stats
    assert stats["kernels"] == 1 and isinstance(fused_nodes(opt)[0].target, FusedRowOp)
    assert opt(*args).dtype == model(*args).dtype == dtype
    assert_same_step(model, opt, args, {}, exact=False)


def test_a_half_precision_cross_entropy_stays_out_with_the_reason():
    model = module(lambda m, x, t: F.cross_entropy(x * 2, t), 2)
    opt = graphopt.optimize(model, (torch.randn(4, 16, dtype=torch.float16), torch.randint(0, 16, (4,))), passes="fuse")
    stats = opt.graphopt_report.passes[-1].stats
    assert stats["kernels"] == 0
    assert "row kernels take its float32 form" in stats["alone"]["mul"]["cross_entropy"]


def test_a_norm_over_the_leading_dims_stays_out():
    opt, stats = fuse(lambda m, x: F.layer_norm(x, (4, 6)) * 3, torch.randn(2, 4, 6, requires_grad=True))
    assert stats["kernels"] == 0 and "normalize the last dim alone" in stats["alone"]["mul"]["layer_norm"]


def test_on_cpu_without_the_interpreter_groups_stay_and_the_report_says_so(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    model = module(hf_rms_norm, 1, weight=torch.nn.Parameter(torch.randn(8)))
    opt = graphopt.optimize(model, (torch.randn(2, 8),), passes="fuse")
    stats = opt.graphopt_report.passes[-1].stats
    assert stats["kernels"] == 0 and not fused_nodes(opt) and "groups" not in stats  # none looked for
    assert "fused kernels run on CUDA" in stats["not_run"]


def test_without_triton_groups_stay_and_the_report_says_how_to_install_it(monkeypatch):
    from graphopt.passes.fuse import fuse_pass
    from graphopt.analysis.planning_device import planning_for

    monkeypatch.setattr(fuse_pass, "triton_installed", lambda: False)
    model = module(hf_rms_norm, 1, weight=torch.nn.Parameter(torch.randn(8)))
    opt = graphopt.optimize(model, (torch.randn(2, 8),), passes="fuse")
    stats = opt.graphopt_report.passes[-1].stats
    assert stats["kernels"] == 0 and not fused_nodes(opt) and "pip install triton" in stats["not_run"]
    with planning_for("cuda"):  # the default pipeline on CUDA skips it, saying why
        opt = graphopt.optimize(model, (torch.randn(2, 8),))
    assert "pip install triton" in opt.graphopt_report.skipped["fuse"]


@pytest.mark.parametrize("case", ["last dim", "channels"])
def test_the_torch_path_equals_the_kernels(monkeypatch, case):
    """A fused graph called on CPU without the interpreter runs the group's steps as torch ops,
    reducing each row over its columns: the last dim, or a batch norm's every dim but the channels."""
    if case == "last dim":
        model = module(lambda m, x: F.softmax(m.ln(x) * 2, -1), 1, ln=torch.nn.LayerNorm(24))
        x = torch.randn(3, 24, requires_grad=True)
    else:
        model = module(lambda m, x: F.relu(m.bn(x)) * 2, 1, bn=torch.nn.BatchNorm2d(4))
        x = torch.randn(2, 4, 3, 5, requires_grad=True)
    opt = graphopt.optimize(model, (x,), passes="fuse")
    assert len(fused_nodes(opt)) == 1
    monkeypatch.delenv("TRITON_INTERPRET")
    assert_same_step(model, opt, (x,), {}, exact=False)


def test_the_estimate_counts_what_a_fused_step_allocates_and_the_norm_saves_less():
    """FakeTensors take the kernels' allocations, so the estimate equals the measured step; a fused
    layer norm keeps its input only, not eager's input, mean and rstd, nor the add's output."""
    model = module(lambda m, x, y: m.ln(x + y).sum(), 2, ln=torch.nn.LayerNorm(256))
    args = (torch.randn(64, 256), torch.randn(64, 256))
    opt, peaks = plain_and_fused_peaks(model, args)
    assert len(fused_nodes(opt)) == 1
    assert peaks["fused"] <= peaks["plain"]


def test_the_zoo_llama_fuses_its_rms_norms():
    model, args, kwargs = zoo.llama(batch=2, seq=8)
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, passes="fuse")
    stats = opt.graphopt_report.passes[-1].stats
    norms = [g for g in stats["groups"] if "rsqrt" in g["ops"] and "row_sum" in g["ops"]]
    assert len(norms) >= 5  # two per block and the last one
    assert_same_step(model, opt, args, kwargs, exact=False)


@settings(max_examples=examples(20), deadline=None)
@given(which=st.sampled_from(["layer_norm", "rms_norm", "softmax", "log_softmax"]), rows=st.integers(1, 5),
       columns=st.integers(2, 300), seed=st.integers(0, 99), residual=st.booleans())
def test_random_rows_equal_eager(which, rows, columns, seed, residual):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(columns, generator=generator))
    norms = {"layer_norm": lambda x: F.layer_norm(x, (columns,), weight, weight * 0.5),
             "rms_norm": lambda x: F.rms_norm(x, (columns,), weight),
             "softmax": lambda x: F.softmax(x, -1), "log_softmax": lambda x: F.log_softmax(x, -1)}

    def fn(m, x, y):
        return norms[which]((x + y) if residual else x) * 1.5

    x = torch.randn(rows, columns, generator=generator, requires_grad=True)
    y = torch.randn(rows, columns, generator=generator)
    opt, stats = fuse(fn, x, y, weight=weight)
    assert stats["kernels"] == 1 and math.prod(x.shape) > 0


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("spelling", ["module", "functional"])
def test_batch_norm_the_residual_add_and_relu_are_one_kernel_and_running_statistics_update_as_in_eager(train, spelling):
    """One row per channel, its columns over the batch and spatial dims. In training the kernel
    normalizes by the batch's statistics and the call updates the running ones (and the module's
    batch count) as eager does; in eval it normalizes by the running ones."""
    def functional(m, x, y):
        return torch.relu(F.batch_norm(x, m.bn.running_mean, m.bn.running_var, m.bn.weight, m.bn.bias,
                                       m.training, 0.1, 1e-5) + y)

    fn = (lambda m, x, y: torch.relu(m.bn(x) + y)) if spelling == "module" else functional
    model = module(fn, 2, bn=torch.nn.BatchNorm2d(3))
    torch.nn.init.normal_(model.bn.weight), torch.nn.init.normal_(model.bn.bias)
    model.bn.running_var.uniform_(0.5, 2.0)
    model.train(train)
    x, y = torch.randn(2, 3, 5, 7, requires_grad=True), torch.randn(2, 3, 5, 7)
    twin = copy.deepcopy(model)
    opt = graphopt.optimize(model, (x, y), passes="fuse")
    (group,) = opt.graphopt_report.passes[-1].stats["groups"]
    assert group["nodes"][-2:] == ["add", "relu"] and ("row_sum" in group["ops"]) is train
    assert_same_step(twin, opt, (x, y), {}, exact=False)  # one step each: twin and model stay alike
    for name, buffer in model.bn.named_buffers():
        assert torch.allclose(buffer.float(), getattr(twin.bn, name).float(), rtol=1e-6, atol=1e-7), name


def test_a_group_norm_says_why_it_stays_out():
    model = module(lambda m, x: torch.relu(m.gn(x)) + 1, 1, gn=torch.nn.GroupNorm(2, 4))
    opt = graphopt.optimize(model, (torch.randn(2, 4, 3, 3),), passes="fuse")
    stats = opt.graphopt_report.passes[-1].stats
    assert group_nodes(stats) == [["relu", "add"]]
    assert stats["groups"][0]["not_fused"]["gn"] == ("group_norm normalizes channels in groups or per sample; row "
                                                     "kernels take batch norm's channels only")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_with_the_logits_scaling_before_it_is_one_kernel(reduction):
    def fn(m, x, t):
        return F.cross_entropy(m.head(x) * 0.5, t, reduction=reduction)

    x, t = torch.randn(7, 12), torch.randint(0, 7, (7,))
    t[3] = -100  # ignored: no loss, no gradient
    opt, stats = fuse(fn, x, t, head=torch.nn.Linear(12, 7))  # 7 rows of 7 classes: shapes alone cannot tell
    assert group_nodes(stats) == [["head", "mul", "cross_entropy"]]  # the head's bias add joins too


def test_cross_entropy_refuses_a_class_index_out_of_range_as_eager_does():
    model = module(lambda m, x, t: F.cross_entropy(x * 2, t), 2)
    opt = graphopt.optimize(model, (torch.randn(4, 5), torch.randint(0, 5, (4,))), passes="fuse")
    assert len(fused_nodes(opt)) == 1
    with pytest.raises(IndexError, match="Target 5 is out of bounds"):
        opt(torch.randn(4, 5), torch.tensor([0, 5, 1, 2]))


def test_cross_entropy_with_label_smoothing_or_class_weights_stays_out():
    model = module(lambda m, x, t: F.cross_entropy(x * 2, t, label_smoothing=0.1), 2)
    opt = graphopt.optimize(model, (torch.randn(4, 5), torch.randint(0, 5, (4,))), passes="fuse")
    assert opt.graphopt_report.passes[-1].stats["alone"]["mul"]["cross_entropy"] == "cross_entropy with label smoothing"


@pytest.mark.parametrize("mask", [False, True])
def test_an_attention_softmax_keeps_its_output_alone_as_eager_does(mask):
    """softmax(scores + bias [+ mask]) @ v: eager's softmax keeps its output, which the matmul after
    it keeps too; the fused group's backward reads that output (y * (g - sum(g * y))), not its
    inputs, so the fused step keeps no score tensor more than eager's (Swin's attention)."""
    def fn(m, qk, v, bias):
        s = qk[0] @ qk[1].transpose(-1, -2) * 0.25 + bias[0]
        if mask:
            s = s + bias[1:, :1]  # a mask per sample, broadcast over the heads
        return (F.softmax(s, -1) @ v).sum()

    qk, v = torch.randn(2, 4, 3, 16, 8, requires_grad=True), torch.randn(4, 3, 16, 8, requires_grad=True)
    args = (qk, v, torch.randn(5, 3, 16, 16) if mask else torch.randn(1, 3, 16, 16))
    model = module(fn, len(args))
    opt, peaks = plain_and_fused_peaks(model, args)
    assert_same_step(model, opt, args, {}, exact=False)
    (call,) = fused_nodes(opt)
    assert call.target.loaded == frozenset(call.target.group.outputs)
    assert peaks["fused"] <= peaks["plain"]


def test_a_linear_head_and_its_cross_entropy_over_a_large_vocabulary_never_make_the_logits():
    """Eager keeps the logits' log_softmax for backward and makes their gradient, [tokens, vocab]
    fp32 each; the head and the loss run over chunks of rows: neither, nor the logits, is ever
    whole (bench/head_loss.py measures a 32k vocabulary)."""
    tokens, hidden, vocab = 32, 16, 8000  # Liger's chunk: one row (the interpreter runs each chunk's kernels)
    model = module(lambda m, x, t: F.cross_entropy(m.head(x), t), 2, head=torch.nn.Linear(hidden, vocab, bias=False))
    args = (torch.randn(tokens, hidden, requires_grad=True), torch.randint(0, vocab, (tokens,)))
    opt, peaks = plain_and_fused_peaks(model, args)
    (call,) = [n for n in opt.graph.nodes if isinstance(n.target, ChunkedHeadLoss)]
    assert not call.target.returns_logits and fused_nodes(opt) == [call]
    assert_same_step(model, opt, args, {}, exact=False)
    logits, weight = tokens * vocab * 4, vocab * hidden * 4
    assert peaks["plain"] >= weight + 3 * logits  # the logits, their log_softmax and their gradient
    assert peaks["fused"] <= 2 * weight + logits // 4  # the weight and its gradient (made in the forward), a chunk


def test_a_head_whose_logits_are_smaller_than_its_weight_is_not_chunked():
    """Chunking makes the head's input and weight gradients in the forward and keeps them to the
    backward: it stays where the estimate says it spares more, the logits' gradient (and the logits)."""
    model = module(lambda m, x, t: F.cross_entropy(m.head(x), t), 2, head=torch.nn.Linear(64, 50))
    opt = graphopt.optimize(model, (torch.randn(4, 64), torch.randint(0, 50, (4,))), passes="fuse")
    (why,) = opt.graphopt_report.passes[-1].stats["heads_not_chunked"].values()
    assert "would peak no lower" in why and isinstance(fused_nodes(opt)[0].target, FusedRowOp)


class _LM(torch.nn.Module):
    """An LM's head and loss as transformers writes them: logits returned, cast to float, flattened
    over batch and tokens, the labels shifted with -100 past the end."""

    def __init__(self, vocab=2000, hidden=64, bias=False):
        super().__init__()
        self.norm, self.head = torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, vocab, bias=bias)

    def forward(self, h, labels):
        logits = self.head(self.norm(h))
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        return loss, logits


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("bias", [False, True])
def test_an_lm_head_returning_its_logits_is_chunked_and_its_logits_keep_their_gradient(frontend, bias):
    model = _LM(bias=bias)
    h, labels = torch.randn(3, 40, 64, requires_grad=True), torch.randint(0, 2000, (3, 40))
    labels[0, 4] = -100
    opt = graphopt.optimize(model, (h, labels), passes="fuse", frontend=frontend)
    (call,) = [n for n in opt.graph.nodes if isinstance(n.target, ChunkedHeadLoss)]
    assert call.target.returns_logits
    assert opt.graphopt_report.passes[-1].stats["chunked_heads"][0]["returns_logits"]
    for use_logits in (False, True):  # the loss alone, and a gradient through the returned logits too
        def total(out):
            return out[0] + (out[1].square().mean() if use_logits else 0)

        got = torch.autograd.grad(total(opt(h, labels)), [h, *model.parameters()])
        want = torch.autograd.grad(total(model(h, labels)), [h, *model.parameters()])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt(h, labels)[1], model(h, labels)[1])


def test_transformers_gpt2_with_a_large_vocabulary_runs_its_head_over_chunks():
    """GPT-2 (transformers) trained on its own loss, its logits returned: the head and the loss over
    chunks; the step (loss and logits both differentiated) equals eager's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=2048, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 2048, (2, 64))
    opt = graphopt.optimize(model, (ids,), example_kwargs={"labels": ids}, passes="normalize,cse,dce,fuse")
    (head,) = opt.graphopt_report.passes[-1].stats["chunked_heads"]
    assert head["returns_logits"]
    assert_same_step(model, opt, (ids,), {"labels": ids}, exact=False)


def test_a_per_row_cross_entropy_is_not_chunked_and_says_why():
    model = module(lambda m, x, t: F.cross_entropy(m.head(x), t, reduction="none"), 2, head=torch.nn.Linear(8, 20))
    opt = graphopt.optimize(model, (torch.randn(6, 8), torch.randint(0, 20, (6,))), passes="fuse")
    (why,) = opt.graphopt_report.passes[-1].stats["heads_not_chunked"].values()
    assert "reduction='none'" in why and len(fused_nodes(opt)) == 1


def rotate_half(x):
    """transformers' rotate_half, spelled as it is."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_rotary_embeddings_on_a_transposed_query_are_one_kernel(frontend):
    """q * cos + rotate_half(q) * sin: the slices, the negation and the cat are read as q shifted
    by half a row each way (no copies of the halves), cos and sin broadcast over the heads, q and
    the result in eager's transposed layout."""
    def fn(m, q, cos, sin):
        q = q.transpose(1, 2)
        return (q * cos) + (rotate_half(q) * sin)

    q, cos, sin = torch.randn(2, 6, 3, 16, requires_grad=True), torch.randn(2, 1, 6, 16), torch.randn(2, 1, 6, 16)
    model = module(fn, 3)
    opt = graphopt.optimize(model, (q, cos, sin), passes="fuse", frontend=frontend)
    assert_same_step(model, opt, (q, cos, sin), {}, exact=False)
    (group,) = opt.graphopt_report.passes[-1].stats["groups"]
    assert group["ops"] == ["mul", "neg", "lt", "where", "mul", "add"]
    assert opt(q, cos, sin).stride() == fn(None, q, cos, sin).stride()


def test_a_cat_of_other_values_says_why_it_stays_out():
    model = module(lambda m, x, y: torch.cat((x * 2, y), -1) * 3, 2)
    opt = graphopt.optimize(model, (torch.randn(2, 4), torch.randn(2, 4)), passes="fuse")
    assert opt.graphopt_report.passes[-1].stats["alone"]["mul_1"]["cat"] == \
        "cat of values other than column slices of one value"


def test_a_residual_add_before_a_norm_keeps_the_sum_for_backward_not_both_addends():
    """The add's backward reads neither addend: the fused call keeps the sum (the norm's input,
    which eager's norm keeps too) and not the addends, so the fused step holds less than eager's."""
    model = module(lambda m, x: m.ln(m.a(x) + m.b(x)).sum(), 1, a=torch.nn.Linear(256, 256),
                   b=torch.nn.Linear(256, 256), ln=torch.nn.LayerNorm(256))
    args = (torch.randn(64, 256),)
    plain = graphopt.optimize(model, args, passes="normalize")
    opt = graphopt.optimize(model, args, passes="fuse")
    (call,) = fused_nodes(opt)
    assert call.target.loaded  # the sum, read back instead of recomputed
    peaks = {label: measured_step_peak(gm, args) for label, gm in (("plain", plain), ("fused", opt))}
    for label, gm in (("plain", plain), ("fused", opt)):
        assert estimate_peak(gm, placeholder_values(gm, args, {})).peak_bytes == peaks[label]
    assert peaks["fused"] <= peaks["plain"]  # eager's norm keeps the sum too (and its statistics)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        saved = []
        loss = opt(*args)
    assert [tuple(t.shape) for t in saved if t.shape == (64, 256)] == [(64, 256)] * 3  # x for two linears, the sum
    loss.backward()
    assert_same_step(model, opt, args, {}, exact=False)


def test_a_fused_graph_runs_at_another_batch_size():
    """Row kernels take their rows from the call's tensors: a graph built on 4 sequences runs on 2
    and on 8 (norms, rotary-free attention softmax, the loss), equal to eager."""
    model, args, kwargs = zoo.llama(batch=4, seq=8)
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, passes="fuse")
    assert any(isinstance(n.target, FusedRowOp) for n in opt.graph.nodes)
    for batch in (2, 8):
        other = zoo.llama(batch=batch, seq=8)
        assert_same_step(model, opt, other[1], other[2], exact=False)


def test_a_batch_norm_in_training_between_two_ops_does_not_keep_them_apart():
    """A BatchNorm module writes its running statistics only, which no group reads: a group may
    span it."""
    def fn(m, x, y):
        h = torch.tanh(x) * 2.0
        z = m.bn(m.c1(y))
        return (h + 1.0) * 3.0, z
    x, y = torch.randn(2, 4, 6, 6, requires_grad=True), torch.randn(2, 4, 6, 6, requires_grad=True)
    opt, stats = fuse(fn, x, y, c1=torch.nn.Conv2d(4, 4, 3, padding=1, bias=False), bn=torch.nn.BatchNorm2d(4))
    assert group_nodes(stats) == [["tanh", "mul", "add", "mul_1"], ["bn"]]


def test_a_batch_norms_weight_computed_from_a_channel_vector_joins_its_group():
    """NFNet's standardized weights: batch_norm(w.reshape(1, C, -1), weight=(gain * scale).view(-1))
    in training; the scale and the reshape of the [C, 1, 1, 1] gain are per-channel values of
    the norm's rows, computed in its kernel."""
    def fn(m, x, w, g):
        weight = F.batch_norm(w.reshape(1, 8, -1), None, None, weight=(g * 0.5).view(-1), training=True,
                              momentum=0.0, eps=1e-6).reshape_as(w)
        return F.conv2d(x, weight) * 2.0
    x, w, g = leaves((2, 4, 6, 6), (8, 4, 3, 3), (8, 1, 1, 1))
    model = module(fn, 3)
    opt = graphopt.optimize(model, (x, w, g), passes="normalize,fuse", verify=True)
    assert group_nodes(opt.graphopt_report.passes[-1].stats) == [["mul", "view", "batch_norm"]]
    assert_same_step(model, opt, (x, w, g), {}, exact=False)


class LayerNorm2d(torch.nn.LayerNorm):
    """timm's: a layer norm over the channels of NCHW, through permutes."""

    def forward(self, x):
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


def test_a_layer_norm_over_channels_through_permutes_is_one_member_with_its_residual_add():
    """CoAtNet's transformer blocks: x + attn(norm(x)), norm a LayerNorm2d. The norm computes in
    x's own shape, its columns along dim 1, the permutes inside it; the add before it joins,
    and its result leaves laid out as eager's permute leaves it (channels last)."""
    def fn(m, x, y):
        h = x + y
        return m.conv(m.norm(h)) + h
    x, y = leaves((2, 8, 5, 5), (2, 8, 5, 5))
    model = module(fn, 2, norm=LayerNorm2d(8), conv=torch.nn.Conv2d(8, 8, 1))
    with torch.no_grad():
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    opt = graphopt.optimize(model, (x, y), passes="normalize,fuse", verify=True)
    stats = opt.graphopt_report.passes[-1].stats
    assert group_nodes(stats) == [["add", "permute", "layer_norm", "permute_1"]]
    (call,) = fused_nodes(opt)
    normed = next(n for n in opt.graph.nodes if n.op == "call_module").args[0]
    assert normed.meta["tensor_info"].stride == (200, 1, 40, 8)  # eager's permute of an NHWC result
    assert_same_step(model, opt, (x, y), {}, exact=False)


def test_with_a_budget_the_loss_chunk_is_the_largest_that_fits():
    from graphopt.analysis.memory import GB

    model = _LM(vocab=2000, hidden=16)
    args = (torch.randn(4, 16, 16, requires_grad=True), torch.randint(0, 2000, (4, 16)))
    rows = 4 * 16
    peaks = {}
    for budget in (1.0, None):  # ample, then the least that fits
        if budget is None:  # between the step with Liger's chunk and with the whole batch in one
            budget = (peaks[rows] + peaks["liger"]) / 2 / GB
        opt = graphopt.optimize(model, args, passes="fuse", budget_gb=budget)
        chunk = opt.graphopt_report.passes[-1].stats["loss_chunk_rows"]
        (call,) = [n for n in opt.graph.nodes if isinstance(n.target, ChunkedHeadLoss)]
        assert call.target.chunk == chunk
        peaks[chunk] = estimate_peak(opt, placeholder_values(opt, args, {})).peak_bytes
        if budget == 1.0:
            assert chunk == rows
            liger = graphopt.optimize(model, args, passes="fuse")
            peaks["liger"] = estimate_peak(liger, placeholder_values(liger, args, {})).peak_bytes
            assert peaks["liger"] < peaks[rows]
        else:
            assert chunk < rows and peaks[chunk] <= budget * GB
            assert_same_step(model, opt, args, {}, exact=False)


def hf_rms_norm_casting(m, x):
    """transformers' LlamaRMSNorm after a linear and a residual add, its casts spelled as they are:
    torch.export checks the dtype of each value cast (aten._assert_tensor_metadata)."""
    h = m.proj(x) + x
    dtype = h.dtype
    h = h.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    return m.weight * (h * torch.rsqrt(variance + 1e-6)).to(dtype)


def _checked(gm) -> list:
    """The values export's dtype checks read."""
    return [n.args[0] for n in gm.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]


def test_a_groups_values_that_only_dtype_checks_read_are_not_stored_and_it_checks_its_inputs_instead():
    model = module(hf_rms_norm_casting, 1, proj=torch.nn.Linear(48, 48), weight=torch.nn.Parameter(torch.randn(48)))
    x = torch.randn(2, 5, 48, requires_grad=True)
    traced = graphopt.optimize(model, (x,), passes="normalize", frontend="export")
    assert any(v.target is torch.ops.aten.add.Tensor for v in _checked(traced))
    opt = graphopt.optimize(model, (x,), passes="fuse", frontend="export")
    (group,) = opt.graphopt_report.passes[-1].stats["groups"]
    (call,) = fused_nodes(opt)
    assert len(group["outputs"]) == 1 and set(call.target.kinds) == {(torch.float32, "cpu")}
    assert len(group["checks_settled"]) == 2  # the sum's, before its cast to float32, and the norm's
    assert not any(v is call or call in v.all_input_nodes for v in _checked(opt))
    assert_same_step(model, opt, (torch.randn(2, 5, 48, requires_grad=True),), {}, exact=False)  # not the example
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(graphopt.UsageError, match="torch.autocast"):
        opt(torch.randn(2, 5, 48))
    model.eval()
    served = graphopt.optimize(model, (x,), passes="fuse", frontend="export", train=False)
    (group,) = served.graphopt_report.passes[-1].stats["groups"]
    assert len(group["outputs"]) == 1 and len(group["checks_settled"]) == 2
    with torch.no_grad():
        other = torch.randn(2, 5, 48)
        torch.testing.assert_close(served(other), model(other))
