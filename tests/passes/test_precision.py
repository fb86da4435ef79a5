"""The precision pass against torch.autocast itself (CPU autocast is the reference).

autocast's dtype for each node comes from running the graph the pass was given node by node
under torch.autocast with an fx Interpreter (precision_plan.autocast_dtypes): the dtypes are
torch's own, not a list of ours.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt import ops
from graphopt.analysis.autocast_plan import autocast_dtypes, dtypes_of
from graphopt.analysis.meta import TensorInfo, tensor_info
from graphopt.passes.notes import notes
from graphopt.passes import PassContext, parse_pipeline
from graphopt.passes.precision import CAST
from graphopt.testing import zoo
from graphopt.frontend.graph_inputs import placeholder_values
from graphopt.verification.verify import TOLERANCE, outputs_and_grads

from conftest import FX_ZOO

BEFORE = "normalize,cse,dce"  # the default pipeline: what the precision pass is given by optimize()
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _precision_row(opt):
    """The precision pass's report row (the default inplace may run after it)."""
    return next(r for r in opt.graphopt_report.passes if r.name.startswith("precision"))


def hf(name):
    pytest.importorskip("transformers")
    return zoo.HF_ZOO[name]()


# every zoo model (two_heads in each of its output forms), and the transformers models by export
FX_MODELS = {**FX_ZOO, **{name: b for name, b in zoo.ZOO.items() if name not in FX_ZOO and name != "two_heads"}}
MODELS = {**{name: (build, "fx") for name, build in FX_MODELS.items()},
          "hf_gpt2": (lambda: hf("hf_gpt2"), "export"), "hf_bert": (lambda: hf("hf_bert"), "export")}


def is_cast(node):
    return str(notes(node).get("precision", "")).startswith(CAST)


def build(name):
    builder, frontend = MODELS[name]
    model, args, kwargs = builder()
    return model, args, kwargs, frontend


def optimized(name, dtype="bf16", **options):
    model, args, kwargs, frontend = build(name)
    spec = f"{BEFORE},precision{{precision={dtype}{''.join(f' {k}={v}' for k, v in options.items())}}}"
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, frontend=frontend, passes=spec)
    return model, args, kwargs, frontend, opt


def assert_autocast_dtypes(name, dtype):
    model, args, kwargs, frontend, opt = optimized(name, dtype)
    given = graphopt.optimize(model, args, example_kwargs=kwargs, frontend=frontend, passes=BEFORE)
    reference = autocast_dtypes(given, placeholder_values(given, args, kwargs), LOW[dtype], "cpu")
    compared, wrong = 0, []
    for node in opt.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module") and not is_cast(node):
            assert node.name in reference, f"{node.name} is not in the graph the pass was given"
            compared += 1
            if dtypes_of(tensor_info(node)) != reference[node.name]:
                wrong.append(f"{node.name}: {dtypes_of(tensor_info(node))} != autocast {reference[node.name]}")
    assert compared > 5 and not wrong, wrong
    return opt


@pytest.mark.parametrize("name", MODELS)
def test_every_op_has_the_dtype_autocast_gives_it(name):
    opt = assert_autocast_dtypes(name, "bf16")
    stats = _precision_row(opt).stats
    assert stats["ops_by_dtype"]["bf16"] > 0 and stats["casts_inserted"] > 0 and stats["declined"] == {}


def test_fp16_dtypes_follow_autocast_too():
    opt = assert_autocast_dtypes("gpt", "fp16")
    assert _precision_row(opt).stats["dtype"] == "fp16"


def test_cuda_autocast_lists_on_a_cuda_graph(monkeypatch):
    # no GPU needed: the graph's device only picks the lists (bench/gpu_precision.py checks
    # the dtypes against CUDA autocast itself on a GPU)
    monkeypatch.setattr(graphopt.passes.precision, "graph_device", lambda gm: "cuda")
    *_, opt = optimized("gpt")
    for node in opt.graph.nodes:
        op = ops.lookup(node, opt)
        if op is not None and op.name in ("layer_norm", "cross_entropy", "linear", "scaled_dot_product_attention_dropout"):
            want = torch.bfloat16 if op.precision == "lower" else torch.float32
            assert tensor_info(node).dtype == want, node.name
    assert _precision_row(opt).stats["autocast_device"] == "cuda"


def _vanishing(reference: dict, key: str) -> bool:
    # Gradients that are zero in exact arithmetic (BERT's key bias: softmax ignores a shift)
    # are rounding noise in any precision; a relative comparison of them says nothing.
    largest = max(float(t.abs().max()) for t in reference.values() if t.numel())
    return float(reference[key].abs().max()) < 1e-3 * largest


@pytest.mark.parametrize("name", ["mlp", "convnet", "gpt", "llama", "two_heads_dataclass", "hf_gpt2", "hf_bert"])
def test_outputs_and_gradients_match_autocast_within_bf16_tolerance(name):
    model, args, kwargs, frontend, opt = optimized(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = outputs_and_grads(model, args, kwargs, train=True, seed=0)
    got = outputs_and_grads(opt, args, kwargs, train=True, seed=0)
    exact = outputs_and_grads(model, args, kwargs, train=True, seed=0)
    assert reference.keys() == got.keys()
    for key, ref in reference.items():
        # Outputs keep the dtype their op produced. Export records GPT-2's `logits.float()`
        # (for its loss) of the float32 trace as the graph's logits output, so there the
        # graph's logits are float32 where eager autocast returns bf16; the values agree.
        if frontend == "fx":
            assert got[key].dtype == ref.dtype, key
        if not _vanishing(exact, key):
            err = float((got[key].double() - ref.double()).abs().max())
            assert err <= TOLERANCE[torch.bfloat16] * float(ref.abs().max()), (key, err)


def test_parameters_stay_float32_masters_cast_once_per_forward():
    for name in ("gpt", "hf_gpt2"):  # both tie the LM head to the token embedding
        model, args, kwargs, _, opt = optimized(name)
        casts = [n for n in opt.graph.nodes if is_cast(n) and n.args[0].op == "get_attr"]
        params = [opt.get_parameter(n.args[0].target) for n in casts]
        assert len({id(p) for p in params}) == len(params) == _precision_row(opt).stats["param_casts"]
        assert all(p.dtype == torch.float32 for p in model.parameters())
        out = opt(*args, **kwargs)
        loss = out.loss if hasattr(out, "loss") else out["loss"]
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)


def test_only_floating_tensors_are_cast():
    for name in ("two_heads_dict", "gpt", "hf_gpt2"):  # a bool mask, integer tokens and targets
        *_, opt = optimized(name)
        for node in opt.graph.nodes:
            if is_cast(node):
                assert tensor_info(node.args[0]).dtype in (torch.float32, torch.bfloat16), node.name


class UserCasts(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc1(x)
        rounded = h.to(torch.bfloat16).float()  # the user rounds on purpose
        return self.fc2(h.float()), rounded + h.float().sum()


def test_user_casts_are_kept_and_back_to_back_casts_fold():
    model, x = UserCasts(), torch.randn(8, 16)
    given = graphopt.optimize(model, (x,), passes=BEFORE)
    written = {n.name: n.target for n in given.graph.nodes if (op := ops.lookup(n, given)) and op.name == "to_dtype"}
    opt = graphopt.optimize(model, (x,), precision="bf16")
    kept = {n.name: n for n in opt.graph.nodes}
    # h.float() twice: cse leaves differentiated values unmerged in training
    assert len(written) == 4 and all(kept[name].target == target for name, target in written.items())
    # fc2 reads fc1's bf16 output: bf16 -> float32 (the user's) -> bf16 (autocast's) folds away
    fc2 = kept["fc2"]
    assert fc2.args[0] is kept["fc1"]
    stats = _precision_row(opt).stats
    assert stats["casts_folded"] >= 1 and stats["activation_casts"] == 1  # x, once
    again = parse_pipeline("precision{precision=bf16}")[0].run(opt, PassContext((x,), {}, train=True))
    assert again.stats["casts_inserted"] == 0  # nothing left to cast, no cast of a cast
    for node in opt.graph.nodes:
        if is_cast(node):
            assert not is_cast(node.args[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    for got, ref in zip(opt(x), expected):
        torch.testing.assert_close(got, ref)


class WithLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.rnn, self.head = nn.Linear(8, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, x):
        y, _ = self.rnn(self.fc(x))
        return self.head(y)


def test_a_call_the_registry_does_not_know_runs_under_autocast_itself():
    # nn.LSTM is opaque to the registry; what autocast does inside it (CPU autocast lowers its
    # mkldnn layers) only autocast knows: the call runs under torch.autocast, as in eager
    model, x = WithLSTM(), torch.randn(2, 5, 8)
    opt = graphopt.optimize(model, (x,), precision="bf16")
    stats = _precision_row(opt).stats
    assert stats["under_autocast"] == ["rnn"] and stats["declined"] == {}
    assert dict(opt.named_parameters()).keys() == dict(model.named_parameters()).keys()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = outputs_and_grads(model, (x,), {}, train=True, seed=0)
    got = outputs_and_grads(opt, (x,), {}, train=True, seed=0)
    assert reference.keys() == got.keys()
    for key in reference:
        assert torch.equal(got[key], reference[key]), key
    assert model.rnn.weight_ih_l0.grad is None  # outputs_and_grads restores gradients


def test_policy_overrides_the_autocast_class():
    *_, plain = optimized("gpt")
    *_, opt = optimized("gpt", precision_policy="linear:fp32;cross_entropy:low")
    kinds = {n.name: ops.lookup(n, opt) for n in opt.graph.nodes}
    dtype = {n.name: tensor_info(n).dtype for n in opt.graph.nodes if isinstance(tensor_info(n), TensorInfo)}
    linears = [name for name, op in kinds.items() if op is not None and op.name == "linear"]
    assert linears and all(dtype[name] == torch.float32 for name in linears)
    assert dtype["scaled_dot_product_attention"] == torch.bfloat16  # not named: still autocast's class
    assert dtype["cross_entropy"] == torch.bfloat16
    plain_dtype = {n.name: tensor_info(n).dtype for n in plain.graph.nodes if isinstance(tensor_info(n), TensorInfo)}
    assert plain_dtype["head"] == torch.bfloat16 and plain_dtype["cross_entropy"] == torch.float32
    stats = _precision_row(opt).stats
    assert stats["policy"] == "cross_entropy:low;linear:fp32"
    # a dict and the text form are one policy, and the pass prints back as a pipeline
    p = graphopt.passes.get("precision")(precision="bf16", precision_policy={"linear": "fp32", "cross_entropy": "low"})
    assert p.spec() == "precision{precision=bf16,precision_policy=cross_entropy:low;linear:fp32}"
    assert parse_pipeline(p.spec())[0].settings == p.settings


@pytest.mark.parametrize("options, message", [
    ({}, "needs precision=bf16 or precision=fp16"),
    ({"precision": "fp8"}, "use bf16 or fp16"),
    ({"precision": "fp32"}, "use bf16 or fp16"),
    ({"precision": "bf16", "precision_policy": {"sofmax": "low"}}, "did you mean softmax"),
    ({"precision": "bf16", "precision_policy": {"softmax": "half"}}, "is not one of low, fp32, promote, follow"),
    ({"precision": "bf16", "precision_policy": "softmax=low"}, "write each entry as op:mode"),
    ({"precision": "bf16", "precision_policy": 3}, "give a dict"),
])
def test_bad_options_say_what_to_write(options, message):
    with pytest.raises(graphopt.OptionError, match=message):
        graphopt.passes.get("precision")(**options)


def test_dtype_spellings_and_the_verifier_tolerance():
    assert graphopt.passes.get("precision")(precision=torch.bfloat16).settings.precision == "bf16"
    assert graphopt.passes.get("precision")(precision="float16").settings.precision == "fp16"
    model, args, kwargs = zoo.gpt()
    # verify=True compares against float32 eager: it passes only at the tolerance of the
    # compute dtype, which the pass reports to the manager
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, precision="bf16", verify=True)
    row = _precision_row(opt)
    assert TOLERANCE[torch.float32] < row.max_rel_err <= TOLERANCE[torch.bfloat16]
    stats = row.stats
    assert stats["bytes_saved"] > 0 and stats["activation_bytes_after"] < stats["activation_bytes_before"]
    assert set(stats["ops_by_dtype"]) == {"bf16", "fp32"}
    marked = {notes(n).get("precision") for n in opt.graph.nodes}
    assert {"bf16", "fp32", "cast bf16"} <= marked


# Training: a teacher-labelled classification task for the zoo MLP.
WIDTH, CLASSES, TRAIN = 32, 10, 1536


def _task():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, WIDTH, generator=g)
    return x, (x @ torch.randn(WIDTH, CLASSES, generator=g)).argmax(1)


def train(precision, steps, scaler=None):
    """Held-out float32 loss of the MLP after `steps` Adam steps through optimize(precision=...)."""
    torch.manual_seed(0)
    x, y = _task()
    model = zoo.MLP(WIDTH, 2, CLASSES, dropout=0.0)
    opt = graphopt.optimize(model, (x[:64],), precision=precision)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        idx = torch.randint(0, TRAIN, (64,), generator=g)
        loss = F.cross_entropy(opt(x[idx]).float(), y[idx])
        optim.zero_grad()
        if scaler is None:
            loss.backward()
            optim.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optim)
            scaler.update()
    with torch.no_grad():
        return F.cross_entropy(model.eval()(x[TRAIN:]), y[TRAIN:]).item()


@pytest.fixture(scope="module")
def float32_loss():
    return train(None, 300)


def test_bf16_training_reaches_the_float32_loss(float32_loss):
    bf16 = train("bf16", 300)
    assert float32_loss < 0.7 * train(None, 0)  # it did learn
    assert abs(bf16 - float32_loss) <= 0.05 * float32_loss, (bf16, float32_loss)


def test_fp16_training_with_grad_scaler(float32_loss):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    fp16 = train("fp16", 300, scaler)
    assert 0 < scaler.get_scale() < float("inf")
    assert abs(fp16 - float32_loss) <= 0.05 * float32_loss, (fp16, float32_loss)


class Promotions(nn.Module):
    """What autocast leaves to type promotion: Python scalars, a float32 buffer and constant, a
    masked_fill and a where filled with finfo of the scores' dtype (DeBERTa's and most attention
    masks' idiom), whose float32 value overflows bf16."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("temperature", torch.tensor(4.0))
        self.register_buffer("bias", torch.randn(8, 8))

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) * 0.25
        scores = scores / torch.sqrt(self.temperature)  # bf16 over a float32 scalar tensor: bf16
        filled = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        kept = torch.where(mask, scores, torch.finfo(scores.dtype).min)
        return (filled.softmax(-1) + kept.softmax(-1) + self.bias).sum()  # float32 again


def test_type_promotion_and_finfo_fills_equal_autocast():
    model, frontend = Promotions(), "export"  # fx cannot ask finfo of a traced dtype
    x, mask = torch.randn(2, 8, 16), torch.rand(2, 8, 8) > 0.3
    mask[:, :, 0] = True
    opt = graphopt.optimize(model, (x, mask), frontend=frontend, passes=f"{BEFORE},precision{{precision=bf16}}")
    assert _precision_row(opt).stats["constants_of_the_new_dtype"] == 2
    given = graphopt.optimize(model, (x, mask), frontend=frontend, passes=BEFORE)
    reference = autocast_dtypes(given, placeholder_values(given, (x, mask), {}), torch.bfloat16, "cpu")
    for node in opt.graph.nodes:
        if node.name in reference and not is_cast(node):
            assert dtypes_of(tensor_info(node)) == reference[node.name], node.name
    for batch in ((x, mask), (torch.randn(2, 8, 16), torch.rand(2, 8, 8) > 0.5)):
        x_ = batch[0].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(x_, batch[1])
        expected.backward()
        got_x = batch[0].clone().requires_grad_()
        got = opt(got_x, batch[1])
        got.backward()
        assert torch.equal(got, expected) and torch.equal(got_x.grad, x_.grad)
