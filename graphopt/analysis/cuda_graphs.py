"""What capturing a training step as CUDA graphs asks of its graph (an analysis).

1. host_syncs: the nodes whose op makes the host wait for the device: a value read back
   (.item(), a tensor's truth), a size that depends on the values (nonzero, masked_select, unique,
   indexing by a boolean mask), a copy to the CPU. A capture records kernels, not waits: such a
   step cannot be captured.
2. random_reruns: recompute segments that draw random numbers, whose rerun restores the RNG
   state the first run saved: reading a CUDA generator's state is not something a capture records.
3. graphs_reserve: the bytes a captured step holds beyond the step as the estimate sees it (the
   step's own allocations are the graphs' memory pool, made during the capture, kept between
   replays): a static copy of every tensor input, a second copy of every trainable parameter's
   gradient (the backward graph's outputs, which autograd then adds into .grad), and the
   optimizer step's temporaries, which no longer reuse the activations' memory (the pool keeps it).
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from .effects import CALLS
from .meta import TensorInfo, tensor_info
from .segments import SegmentCall

# ops whose result the host must read back, or whose output size depends on the values
_SYNCING = {"_local_scalar_dense", "item", "nonzero", "argwhere", "masked_select", "unique", "_unique", "_unique2",
            "unique_consecutive", "unique_dim", "bincount", "equal", "is_nonzero", "allclose", "tolist", "numpy",
            "__bool__", "__int__", "__float__", "cpu"}
_TRUTH = (bool, int, float)


def _name(node: torch.fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", "")


def host_syncs(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Step 1: the syncing nodes, by name, with what they do."""
    found = {}
    for node in gm.graph.nodes:
        if node.op not in CALLS:
            continue
        name = _name(node)
        truth = node.op == "call_function" and node.target in _TRUTH and any(
            isinstance(tensor_info(v), TensorInfo) for v in node.all_input_nodes)  # bool(t), int(t), float(t)
        if name in _SYNCING or truth:
            found[node.name] = f"{name} reads a value back to the host"
        elif _to_host(node):
            found[node.name] = f"{name} copies a CUDA tensor to the CPU"
        elif _masked_index(node):
            found[node.name] = f"{name} indexes by a boolean mask, whose result's size the values decide"
    for module in {n.target.module for n in gm.graph.nodes if isinstance(n.target, SegmentCall)}:
        found.update(host_syncs(module))
    return found


def _to_host(node: torch.fx.Node) -> bool:
    made = tensor_info(node)
    sources = [tensor_info(v) for v in node.all_input_nodes]
    return (isinstance(made, TensorInfo) and made.device.type == "cpu"
            and any(isinstance(s, TensorInfo) and s.device.type == "cuda" for s in sources))


def _masked_index(node: torch.fx.Node) -> bool:
    if _name(node) not in ("index", "getitem") and node.target is not operator.getitem:
        return False
    indices = node.args[1] if len(node.args) > 1 else ()
    indices = indices if isinstance(indices, (list, tuple)) else (indices,)
    return any(isinstance(i, torch.fx.Node) and isinstance(tensor_info(i), TensorInfo)
               and tensor_info(i).dtype == torch.bool for i in indices)


def random_reruns(gm: torch.fx.GraphModule) -> list[str]:
    """Step 2: the recompute segments that draw random numbers, by node name."""
    return [n.name for n in gm.graph.nodes if isinstance(n.target, SegmentCall) and getattr(n.target, "draws", False)]


def input_bytes(flat_inputs: list) -> int:
    """Bytes of the tensors among a graph's inputs: what one more copy of a batch takes (a captured
    step's static inputs; a batch prefetched ahead of the step)."""
    return sum(t.numel() * t.element_size() for t in flat_inputs if isinstance(t, torch.Tensor))


def graphs_reserve(gm: torch.fx.GraphModule, flat_inputs: list, optimizer=None) -> int:
    """Step 3, in bytes; optimizer: analysis/optimizer_memory.OptimizerMemory or None."""
    inputs = input_bytes(flat_inputs)
    grads = sum(p.numel() * p.element_size() for p in gm.parameters() if p.requires_grad)
    return inputs + grads + (optimizer.step_bytes if optimizer is not None else 0)
