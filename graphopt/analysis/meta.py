"""What tracing records on every node: shape, dtype, device, stride and bytes of each tensor it makes.

Passes and analyses read `tensor_info(node)` instead of poking at FakeTensors, so the
answer is the same whichever frontend captured the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..vocabulary.precisions import torch_name
from .planning_device import planning_device

KEY = "tensor_info"
ANNOTATED = "graphopt_annotated"  # set on every node the last FakeTensor run reached


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    stride: tuple[int, ...]
    nbytes: int
    requires_grad: bool = False

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorInfo":
        shape = tuple(int(s) for s in t.shape)
        numel = 1
        for s in shape:
            numel *= s
        return cls(
            shape=shape,
            dtype=t.dtype,
            device=t.device,
            stride=tuple(int(s) for s in t.stride()) if t.layout == torch.strided else (),
            nbytes=numel * t.element_size(),
            requires_grad=bool(t.requires_grad),
        )

    @property
    def contiguous(self) -> bool:
        step = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != step:
                return False
            step *= size
        return True

    def short(self) -> str:
        return f"{torch_name(self.dtype)}[{','.join(map(str, self.shape))}]"


def dense(info: TensorInfo) -> bool:
    """Whether the tensor's elements fill its storage span exactly once in some order of its dims
    (a contiguous tensor, or a permutation of one, such as a transpose)."""
    dims = sorted((st, size) for size, st in zip(info.shape, info.stride) if size != 1)
    expected = 1
    for st, size in dims:
        if st != expected:
            return False
        expected *= size
    return True


def describe_value(value):
    """TensorInfo for a tensor, a tuple of them for a tuple/list output, None otherwise."""
    if isinstance(value, torch.Tensor):
        return TensorInfo.of(value)
    if isinstance(value, (tuple, list)):
        infos = tuple(describe_value(v) for v in value)
        return infos if any(i is not None for i in infos) else None
    return None


def record(node: torch.fx.Node, value) -> None:
    info = describe_value(value)
    if info is None:
        node.meta.pop(KEY, None)
    else:
        node.meta[KEY] = info


def leaves(info):
    """The TensorInfos in what tensor_info returns: itself, or those in its tuple, nested ones
    included (nn.LSTM's (y, (h, c)))."""
    if isinstance(info, TensorInfo):
        yield info
    elif isinstance(info, tuple):
        for i in info:
            yield from leaves(i)


def tensor_info(node: torch.fx.Node):
    """The node's TensorInfo (or tuple of them); None for nodes that make no tensor."""
    return node.meta.get(KEY)


def is_annotated(node: torch.fx.Node) -> bool:
    return node.meta.get(ANNOTATED, False)


def gather(dst: torch.fx.Node, srcs: list[torch.fx.Node], single: bool) -> None:
    """dst's metadata for a call that returns srcs' values, as one FakeTensor run would record
    it: their value itself where single, else their tuple, in the run that annotated srcs
    (nothing where one of them lacks it), without running the graph again."""
    for key in ("val", "tensor_meta", KEY, ANNOTATED, "stack_trace"):
        values = [s.meta.get(key) for s in srcs]
        if values and all(v is not None for v in values):
            dst.meta[key] = values[0] if single or key in (ANNOTATED, "stack_trace") else tuple(values)
    stack = common_stack(srcs)
    if stack:
        dst.meta["nn_module_stack"] = stack


def common_stack(nodes: list[torch.fx.Node]) -> dict:
    """The nn_module_stack entries every node runs in, outermost first: a call made of them (a
    fused group) runs in those modules, in one block where all of its nodes do (blocks.py)."""
    stacks = [list((n.meta.get("nn_module_stack") or {}).items()) for n in nodes]
    common = stacks[0] if stacks else []
    for stack in stacks[1:]:
        k = 0
        while k < min(len(common), len(stack)) and common[k] == stack[k]:
            k += 1
        common = common[:k]
    return dict(common)


def invalidate(node: torch.fx.Node) -> None:
    """For a pass that rewrites a node in place so it computes something else: its metadata
    is stale, and the pass manager re-annotates the graph."""
    for key in ("val", "tensor_meta", KEY, ANNOTATED):
        node.meta.pop(key, None)


def graph_device(gm: torch.fx.GraphModule) -> str:
    """The device type the graph computes on (autocast's lists and the cost rates differ by
    device): that of its first floating-point input or attribute, else of its parameters and
    buffers, else of any tensor input; "cpu" for a graph without tensors. While planning
    (planning_device.py), the device planned for: the graph is a meta model's, whose fakes are
    on the CPU."""
    planned = planning_device()
    if planned is not None:
        return planned
    for node in gm.graph.nodes:
        info = tensor_info(node)
        if node.op in ("placeholder", "get_attr") and isinstance(info, TensorInfo) and info.dtype.is_floating_point:
            return info.device.type
    for t in (*gm.parameters(), *gm.buffers()):
        return t.device.type
    for node in gm.graph.nodes:
        info = tensor_info(node)
        if node.op == "placeholder" and isinstance(info, TensorInfo):
            return info.device.type
    return "cpu"
