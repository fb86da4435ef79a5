"""A module's state as FakeTensors, for analyses that run a graph without touching memory.

fake_run is the one way graphopt sets up such a run: a FakeTensorMode, the module's state
swapped for fakes, and the inputs as fakes of the same mode.

Inside planning_device.planning_for(device), a meta tensor's fake is made on the CPU, so that
ops run a real device's kernels (planning_device.py)."""
from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from .fake_kernels import Fakes
from .fake_kernels import active as fake_kernels_active
from .planning_device import planning_device
from .segments import SegmentCall, segment_modules


def faker(mode: FakeTensorMode):
    """mode.from_tensor, with meta tensors made on the CPU while planning (memoized, as
    from_tensor is, so that a tensor shared stays one fake)."""
    if planning_device() is None:
        return mode.from_tensor
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            return mode.from_tensor(t)
        if id(t) not in made:
            made[id(t)] = f = mode.fake_tensor_converter.from_meta_and_device(mode, t, torch.device("cpu"))
            f.requires_grad_(t.requires_grad)
            if t.grad is not None:  # as from_tensor fakes a gradient with its tensor
                f.grad = fake(t.grad)
        return made[id(t)]
    return fake


@contextlib.contextmanager
def fake_run(module: torch.nn.Module, inputs):
    """Open a FakeTensor run of `module`: yields (mode, inputs with every tensor a fake of that
    mode, in the same structure). The mode is not entered: callers enter it around what runs."""
    mode = Fakes(allow_non_fake_inputs=True)
    fake = faker(mode)
    with fake_kernels_active(), fake_state(module, mode, fake):
        yield mode, pytree.tree_map_only(torch.Tensor, fake, inputs)


@contextlib.contextmanager
def fake_state(module: torch.nn.Module, mode: FakeTensorMode, fake):
    """Swap the module's parameters, buffers and a graph's tensor constants (export lifts a
    tensor forward reaches other than as a buffer) for FakeTensors while the context is open;
    the same for the graph of every recompute segment it calls, which holds its own references.

    Nothing real is allocated or written: BatchNorm's in-place counter updates land on fakes,
    a backward's gradients on fake parameters, and models built on the meta device run just
    the same. from_tensor memoizes, so a tensor shared (tied weights, a segment's parameter)
    stays one fake tensor.
    """
    modules, k = [module], 0
    while k < len(modules):
        if isinstance(modules[k], torch.fx.GraphModule):
            modules += segment_modules(modules[k])
        k += 1
    # Every state read before any swap: a segment shares leaf modules with its graph.
    states = [(m, {name: fake(t) for name, t in _state(m).items()}) for m in modules]
    with contextlib.ExitStack() as stack:
        for m, fakes in states:
            stack.enter_context(_reparametrize_module(m, fakes))
        yield


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, buffers and, for a graph, the tensor attributes its get_attr nodes read."""
    state = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers(remove_duplicate=False))}
    if isinstance(module, torch.fx.GraphModule):
        for node in module.graph.nodes:
            if node.op == "get_attr" and node.target not in state:
                value = functools.reduce(getattr, node.target.split("."), module)
                if isinstance(value, torch.Tensor):
                    state[node.target] = value
    return state


def fake_copy(module: torch.nn.Module, mode: FakeTensorMode, inputs):
    """A deep copy of module whose parameters, buffers and tensor constants are FakeTensors of
    mode (nothing real is copied), recompute segments included, and inputs with every tensor a
    fake of the same mode: for a run that changes the module for good (fully_shard replaces its
    parameters and its class)."""
    fake = faker(mode)
    memo: dict[int, object] = {}
    modules = [module]
    for m in modules:
        if isinstance(m, torch.fx.GraphModule):
            modules += [s for s in segment_modules(m) if s not in modules]
    for m in modules:
        for t in _state(m).values():
            if id(t) not in memo:  # faked as itself: faker's memo is by id, a temporary's is reused
                f = fake(t).detach()
                memo[id(t)] = torch.nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else f
    copy_ = copy.deepcopy(module, memo)
    # a graph's copy keeps its nodes' targets: a segment's call must run the segment's copy
    for m in copy_.modules():
        if isinstance(m, torch.fx.GraphModule) and _copy_segments(m, memo):
            m.recompile()
    return copy_, pytree.tree_map_only(torch.Tensor, fake, inputs)


def _copy_segments(gm: torch.fx.GraphModule, memo: dict) -> bool:
    changed = False
    for node in gm.graph.nodes:
        if isinstance(node.target, SegmentCall):
            call = copy.copy(node.target)
            call.module = memo.get(id(node.target.module)) or copy.deepcopy(node.target.module, memo)
            _copy_segments(call.module, memo)
            node.target, changed = call, True
    return changed
