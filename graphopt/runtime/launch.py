"""Launching a generated Triton kernel with everything but its tensors bound once.

1. bind(kernel, grid, scalars, constexprs, device) is called at the first call of a fused op's
   input signature; the launch it returns takes the pointer tensors alone. The grid, the integer
   arguments (sizes, strides: fixed by the signature) and the constexprs are bound.
2. On CUDA the kernel is compiled through Triton's own JITFunction (warmup: it specializes on the
   arguments, the pointers' 16-byte alignment included), and the launch calls the compiled
   kernel's launcher directly with its function, metadata and grid bound, as Inductor's generated
   launchers do, not JITFunction.run, which binds, specializes and hashes its arguments again at
   every call. The launcher is given what JITFunction.run gives it: the arguments its compiled
   source's signature names, in the kernel's parameter order, and Triton's launch hooks. Where it
   cannot be bound so (a launch hook set, a Triton whose compiled kernel lacks what that needs),
   or where a later call's pointers are not aligned as the first call's were, is on another
   device, or a hook was set since, the launch goes through JITFunction.run.
3. Under Triton's interpreter (CPU tensors, TRITON_INTERPRET=1: how tests run the kernels) each
   launch goes through the interpreter, and the reference cycle it leaves holding the tensors is
   collected (release_interpreted_arguments).
4. no_kernel_launches() runs everything a step does on the host but the launches themselves: what a
   step costs the host, measured without a GPU (graphopt.testing re-exports it).
"""
from __future__ import annotations

import contextlib
import gc
import os
from typing import Callable

import torch

_LAUNCHING = [True]  # False inside no_kernel_launches()
BIND_LAUNCHERS = [True]  # False: every CUDA launch through JITFunction.run (bench/gpu_step_time.py compares)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@contextlib.contextmanager
def no_kernel_launches():
    """Inside, graphopt's fused calls do all their host work (checks, allocations, autograd) but
    launch no kernel: their outputs hold whatever their memory held. For profiling host time."""
    before = _LAUNCHING[0]
    _LAUNCHING[0] = False
    try:
        yield
    finally:
        _LAUNCHING[0] = before


def release_interpreted_arguments() -> None:
    """Triton's interpreter keeps a launch's tensor storages in a reference cycle (a recursive
    closure over a dict of them) until Python collects it, which can be long after the tensors'
    last use: a measured step would hold them where a GPU run does not. The cycle is young, so a
    collection of the youngest generation frees it."""
    gc.collect(0)


def bind(kernel, grid: tuple, scalars: tuple, constexprs: dict, device: torch.device) -> Callable[..., None]:
    """The launch of `kernel` over `grid` with these integer arguments after its pointers and these
    constexprs; it takes the pointer tensors, in the kernel's parameter order."""
    if device.type != "cuda" or interpreting():
        def interpreted(*pointers):
            if _LAUNCHING[0]:
                kernel[grid](*pointers, *scalars, **constexprs)
                release_interpreted_arguments()
        return interpreted
    return _cuda_launch(kernel, grid, tuple(scalars), dict(constexprs), device)


def _jit_launch(kernel, grid, scalars, constexprs, device):
    def launch(*pointers):
        if _LAUNCHING[0]:
            if device.index != torch.cuda.current_device():
                with torch.cuda.device(device):
                    kernel[grid](*pointers, *scalars, **constexprs)
            else:
                kernel[grid](*pointers, *scalars, **constexprs)
    return launch


def _cuda_launch(kernel, grid, scalars, constexprs, device):
    """Step 2: compiled at the first launch (not at bind: no_kernel_launches binds without
    compiling), then the compiled kernel's launcher with everything but the pointers bound."""
    slow = _jit_launch(kernel, grid, scalars, constexprs, device)
    if not BIND_LAUNCHERS[0]:
        return slow
    state: dict = {}

    def first(*pointers):
        if not _LAUNCHING[0]:
            return
        with torch.cuda.device(device):  # the compiled kernel's module is loaded for the tensors' device
            compiled = kernel.warmup(*pointers, *scalars, grid=grid, **constexprs)
            fast = _bound(kernel, compiled, grid, scalars, constexprs, device, pointers)
        state["launch"] = fast or slow
        state["launch"](*pointers)

    state["launch"] = first
    return lambda *pointers: state["launch"](*pointers)


def _launch_hooks() -> tuple:
    """Triton's launch hooks as JITFunction.run passes them: (enter, exit); a profiler's hooks
    are in them (Triton 3.4 and newer keep them in knobs, a HookChain from 3.5 on)."""
    from triton import knobs  # noqa: PLC0415

    return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def _set(hook) -> bool:
    """Whether a launch hook would call anything (a HookChain holds its calls)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _bound(kernel, compiled, grid, scalars, constexprs, device, pointers):
    """The compiled kernel's launcher with grid, function, metadata and hooks bound, or None where
    this Triton's compiled kernel does not offer what that needs, or a launch hook is set (a
    profiler's: it is given each launch's metadata, which the bound launch does not make)."""
    try:
        hooks = _launch_hooks()
        if any(_set(h) for h in hooks):
            return None
        run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
        names = list(kernel.arg_names)
        signature = compiled.src.signature
    except (AttributeError, ImportError):
        return None
    given = dict(zip(names, [*pointers, *scalars]))
    given.update(constexprs)
    # what JITFunction.run passes: every argument its compiled source's signature names (constexprs
    # too, from Triton 3.3 on), in parameter order; the pointers are the first parameters
    wanted = [names[k] if isinstance(k, int) else k for k in signature]
    if set(wanted) - set(given) or wanted[:len(pointers)] != names[:len(pointers)]:
        return None
    rest = tuple(given[w] for w in wanted[len(pointers):])
    aligned = [i for i, p in enumerate(pointers) if p.data_ptr() % 16 == 0]
    g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw_stream, current = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice
    enter, leave = hooks
    added = [getattr(h, "calls", None) for h in hooks if getattr(h, "calls", None) is not None]  # live lists
    slow = _jit_launch(kernel, grid, scalars, constexprs, device)

    def launch(*tensors):
        if not _LAUNCHING[0]:
            return
        if current() != index or any(tensors[i].data_ptr() % 16 for i in aligned) or any(added):
            slow(*tensors)  # on the tensors' device; compiled by Triton for this alignment; a hook added since
            return
        run(g0, g1, g2, raw_stream(index), function, metadata, None, enter, leave, *tensors, *rest)

    return launch
