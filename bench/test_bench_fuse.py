"""The fuse pass on elementwise chains, measured in one run against its baselines (bench/gpu_fuse.py
holds the chains and the measurements; `python bench/gpu_fuse.py` runs the whole GPU matrix at once).

- On CUDA: chains of 2, 4 and 8 ops on 2^20 .. 2^26 elements, float32 and bfloat16, forward and
  forward+backward: eager, graphopt and torch.compile, bandwidth as a fraction of a device copy;
  first training step of graphopt (optimize() included) against torch.compile's.
- Without CUDA (skip mode): small sizes, graphopt (its kernels in Triton's interpreter) against
  eager for correctness, and graphopt's first step; torch.compile is skipped (its CPU code says
  nothing about the GPU goal).
Figures are printed at the end of the run (bench/conftest.py).
"""
import gpu_fuse
import pytest
import torch
from conftest import rounds

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    """Without CUDA the fused kernels run in Triton's interpreter (off it, fuse leaves groups alone)."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def sizes(quick: bool) -> tuple:
    if CUDA:
        return gpu_fuse.GPU_SIZES[:1] if quick else gpu_fuse.GPU_SIZES
    return gpu_fuse.CPU_SIZES[:1]


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", list(gpu_fuse.DTYPES))
@pytest.mark.parametrize("length", gpu_fuse.LENGTHS)
def test_chain(benchmark, quick, figures, length, dtype, backward):
    if quick and (length != 4 or dtype != "float32"):
        pytest.skip("quick mode runs the 4-op float32 chain")
    compiled = torch.compile(gpu_fuse.Chain(length)) if CUDA else None
    time_fn = gpu_fuse.timer(DEVICE)
    for n in sizes(quick):
        row = gpu_fuse.measure(length, n, gpu_fuse.DTYPES[dtype], backward, DEVICE, compiled, time_fn)
        figures(**{k: v for k, v in row.items() if k not in ("ops", "chain", "dtype", "pass")})
    # pytest-benchmark's own table: graphopt at the largest size
    module = gpu_fuse.Chain(length)
    x, b, g = gpu_fuse.make_inputs(n, gpu_fuse.DTYPES[dtype], DEVICE, backward)
    run = gpu_fuse.runner(gpu_fuse.fuse(module, x, b), x, b, g, backward)
    benchmark.pedantic(lambda: (run(), gpu_fuse.sync(DEVICE)), rounds=rounds(quick, 20), iterations=1,
                       warmup_rounds=1)


@pytest.mark.parametrize("length", gpu_fuse.LENGTHS)
def test_first_step(benchmark, quick, figures, length):
    if quick and length != 8:
        pytest.skip("quick mode runs the 8-op chain")
    row = benchmark.pedantic(lambda: gpu_fuse.first_call(length, DEVICE, with_compile=CUDA), rounds=1, iterations=1)
    figures(**row)
