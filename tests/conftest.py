import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# every plan made afresh (the plan cache is tested with its own directories)
os.environ.setdefault("GRAPHOPT_PLAN_CACHE", "off")

import hypothesis_profiles  # noqa: E402, F401  (loads the profile before test modules build their @settings)

import pytest
import torch

from graphopt.testing import zoo
from graphopt.analysis.trial import tensor_leaves
from graphopt.verification.verify import compare, float64_copy


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def step(module, args, kwargs, seed=0):
    """Outputs and parameter gradients of one training step (same RNG seed each call)."""
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = module(*args, **kwargs)
    leaves = tensor_leaves(out)
    loss = sum((t.float() * (i + 1)).sum() for i, t in enumerate(leaves) if t.is_floating_point())
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    for p in module.parameters():
        p.grad = None
    return [t.detach() for t in leaves], grads


def measured_step_peak(gm, args) -> int:
    """Peak bytes of live tensor storages through forward and backward of a module returning a
    scalar, beyond its parameters and the arguments; gradients None before and after."""
    from graphopt.analysis.live_storage import LiveStorage

    with LiveStorage([*gm.parameters(), *args]) as live:
        gm(*args).backward()
    for p in gm.parameters():
        p.grad = None
    return live.peak


def plain_and_fused_peaks(model, args) -> tuple:
    """The model through passes="fuse", and the measured step peaks of it and of the same graph
    unfused (passes="normalize"), each asserted equal to the memory estimate (FakeTensors take
    the kernels' allocations); same RNG seed for both."""
    import graphopt
    from graphopt.analysis.memory import estimate_peak
    from graphopt.frontend.graph_inputs import placeholder_values

    graphs = {"plain": graphopt.optimize(model, args, passes="normalize"),
              "fused": graphopt.optimize(model, args, passes="fuse")}
    peaks = {}
    for label, gm in graphs.items():
        torch.manual_seed(0)
        peaks[label] = measured_step_peak(gm, args)
        assert estimate_peak(gm, placeholder_values(gm, args, {})).peak_bytes == peaks[label], label
    return graphs["fused"], peaks


def assert_same_step(model, opt, args, kwargs, exact=True, tol=1e-5):
    """Bitwise, or (exact=False) within tol relative to each entry's largest element, or no further
    from a float64 step than ten times float32 eager is (graphopt.verification.verify.compare, as the corpus)."""
    ref_out, ref_grads = step(model, args, kwargs)
    got_out, got_grads = step(opt, args, kwargs)
    assert len(ref_out) == len(got_out) > 0
    for r, g in zip(ref_out, got_out):
        assert r.shape == g.shape and r.dtype == g.dtype
        if exact:
            assert torch.equal(r, g), float((r - g).abs().max())
    assert ref_grads.keys() == got_grads.keys()
    for name in ref_grads:
        if exact:
            assert torch.equal(ref_grads[name], got_grads[name]), name
    if exact:
        return
    reference = {**{f"out{i}": t for i, t in enumerate(ref_out)}, **ref_grads}
    got = {**{f"out{i}": t for i, t in enumerate(got_out)}, **got_grads}
    errors = compare(reference, got, tolerance=tol)
    if errors.max_rel > tol:
        wide_out, wide_grads = step(*float64_copy(model, args, kwargs))
        truth = {**{f"out{i}": t for i, t in enumerate(wide_out)}, **wide_grads}
        errors = compare(reference, got, truth, tol)
    assert errors.max_rel <= tol, errors


FX_ZOO = {
    "mlp": zoo.mlp,
    "convnet": zoo.convnet,
    "gpt": zoo.gpt,
    "llama": zoo.llama,
    "two_heads_tuple": lambda: zoo.two_heads("tuple"),
    "two_heads_dict": lambda: zoo.two_heads("dict"),
    "two_heads_dataclass": lambda: zoo.two_heads("dataclass"),
}


def pytest_addoption(parser):
    parser.addoption("--corpus", choices=("quick", "all"), default="quick",
                     help="real-model corpus: the quick subset (make test) or every model (make test-real)")
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run every N-th collected test from the I-th (0-based): make test-real runs N=2 "
                          "halves at once")


def pytest_collection_modifyitems(config, items):
    """--shard=I/N keeps items[I::N]: neighbours in collection order cost alike, so halves balance."""
    shard = config.getoption("--shard")
    if shard is None:
        return
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard={shard}: expected I/N with 0 <= I < N, e.g. 0/2") from None
    if not 0 <= i < n:
        raise pytest.UsageError(f"--shard={shard}: expected I/N with 0 <= I < N, e.g. 0/2")
    config.hook.pytest_deselected(items=[t for k, t in enumerate(items) if k % n != i])
    items[:] = items[i::n]


def pytest_generate_tests(metafunc):
    """corpus_model: every real-model corpus model under --corpus=all, else corpus.QUICK."""
    if "corpus_model" in metafunc.fixturenames:
        from corpus import CORPUS, QUICK

        all_ = metafunc.config.getoption("--corpus") == "all"
        metafunc.parametrize("corpus_model", list(CORPUS) if all_ else list(QUICK))
