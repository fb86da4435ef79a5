"""runtime/launch.py's bound CUDA launch, on CPU: a stand-in for Triton's JITFunction and its compiled
kernel records what each launch passes. The bound launcher gets what JITFunction.run would give the
compiled kernel's launcher (the arguments its signature names, in order); a pointer not aligned as at
the first launch, a hook a profiler set, or a compiled kernel without what binding needs goes through
JITFunction. The real launch runs in `make gpu` (bench/gpu_step_time.py checks bound against unbound)."""
import contextlib
import types

import pytest
import torch

from graphopt.runtime import launch
from graphopt.testing import no_kernel_launches

GRID, SCALARS, CONSTEXPRS = (4,), (10,), {"BLOCK": 128}
DEVICE = torch.device("cuda", 0)


class Compiled:
    def __init__(self, signature, log):
        self.src = types.SimpleNamespace(signature=signature)
        self.function, self.packed_metadata = "function", "metadata"
        self.run = lambda *args: log.append(("run", args))


class Kernel:
    """A JITFunction: warmup compiles (returns the compiled kernel), kernel[grid](...) launches."""

    arg_names = ["x_ptr", "out_ptr", "n", "BLOCK"]

    def __init__(self, signature):
        self.log, self.signature = [], signature

    def warmup(self, *args, grid, **kwargs):
        self.log.append(("warmup", args, grid, kwargs))
        return Compiled(self.signature, self.log)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(("jit", args, kwargs))


@pytest.fixture(autouse=True)
def cuda_stand_ins(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(launch, "_launch_hooks", lambda: (None, None))


def launched(kernel, *tensors):
    go = launch.bind(kernel, GRID, SCALARS, CONSTEXPRS, DEVICE)
    go(*tensors)
    go(*tensors)
    return go


def test_the_launcher_gets_what_jitfunction_run_gives_it():
    kernel = Kernel({"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"})
    x, out = torch.zeros(64), torch.zeros(64)
    launched(kernel, x, out)
    assert [e[0] for e in kernel.log] == ["warmup", "run", "run"]  # compiled once, then the launcher
    _, args = kernel.log[-1]
    assert args[:9] == (4, 1, 1, 7, "function", "metadata", None, None, None)
    assert args[9] is x and args[10] is out and args[11:] == (10, 128)


def test_a_triton_whose_signature_leaves_out_constexprs_gets_none():
    kernel = Kernel({0: "*fp32", 1: "*fp32", 2: "i32"})  # Triton 3.0's: by place, constexprs apart
    launched(kernel, torch.zeros(64), torch.zeros(64))
    assert kernel.log[-1][1][11:] == (10,)


def test_an_unaligned_pointer_goes_through_jitfunction():
    kernel = Kernel({"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"})
    x, out = torch.zeros(64), torch.zeros(64)
    go = launched(kernel, x, out)
    go(x[1:], out[1:])  # 4 bytes in: the compiled kernel assumed 16-byte aligned pointers
    assert kernel.log[-1][0] == "jit" and kernel.log[-1][2] == CONSTEXPRS


def test_a_launch_hook_or_a_kernel_without_what_binding_needs_goes_through_jitfunction(monkeypatch):
    chain = types.SimpleNamespace(calls=[print])  # a profiler's hook in Triton's HookChain
    monkeypatch.setattr(launch, "_launch_hooks", lambda: (chain, None))
    kernel = Kernel({"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"})
    launched(kernel, torch.zeros(64), torch.zeros(64))
    assert [e[0] for e in kernel.log] == ["warmup", "jit", "jit"]
    monkeypatch.setattr(launch, "_launch_hooks", lambda: (None, None))
    kernel = Kernel({"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"})
    kernel.warmup = lambda *args, grid, **kwargs: object()  # no run, function, metadata or source
    launched(kernel, torch.zeros(64), torch.zeros(64))
    assert [e[0] for e in kernel.log] == ["jit", "jit"]


def test_a_hook_added_after_binding_sends_launches_through_jitfunction(monkeypatch):
    chain = types.SimpleNamespace(calls=[])
    monkeypatch.setattr(launch, "_launch_hooks", lambda: (chain, chain))
    kernel = Kernel({"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"})
    go = launched(kernel, torch.zeros(64), torch.zeros(64))
    chain.calls.append(print)
    go(torch.zeros(64), torch.zeros(64))
    assert [e[0] for e in kernel.log] == ["warmup", "run", "run", "jit"]


def test_unbound_launchers_and_no_launches():
    kernel = Kernel({"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"})
    launch.BIND_LAUNCHERS[0] = False
    try:
        launched(kernel, torch.zeros(64), torch.zeros(64))
    finally:
        launch.BIND_LAUNCHERS[0] = True
    assert [e[0] for e in kernel.log] == ["jit", "jit"]
    kernel = Kernel({"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"})
    with no_kernel_launches():
        launched(kernel, torch.zeros(64), torch.zeros(64))
    assert kernel.log == []  # nothing compiled, nothing launched
