"""Mixture-of-experts matmuls as eager runs them: transformers' grouped matmul fallback back to
torch._grouped_mm (normalize's step 11).

transformers routes a MoE layer's experts through `torch._grouped_mm` when it runs eagerly, but
while torch traces it (export included) it hands experts that are not bfloat16 to its own
operator `transformers::grouped_mm_fallback`, because inductor compiles the grouped kernel for
bfloat16 only. The fallback is a Python loop of one matmul per expert, and its backward another:
graphopt runs the exported graph with ATen's kernels, not inductor's, so the trace ran slower
code than the step it stands for. Where the real `_grouped_mm` kernel takes the call's operands
(the checks ATen makes, fake_kernels.grouped_mm_output, on the node's FakeTensors, and one tiny
real call per device and dtype), the node calls it, as eager does, with the same arguments.
"""
from __future__ import annotations

import functools

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from ..analysis import meta
from ..analysis.fake_kernels import grouped_mm_output

FALLBACK = "transformers::grouped_mm_fallback"


def eager_grouped_mm(gm: torch.fx.GraphModule) -> int:
    """Rewrite each call of the fallback whose operands the real kernel takes; the number rewritten."""
    done = 0
    for node in gm.graph.nodes:
        target = node.target if node.op == "call_function" else None
        if not isinstance(target, torch._ops.OpOverload) or target.name() != FALLBACK:
            continue
        bound = normalize_function(target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        if bound is None or set(bound.kwargs) != {"input", "weight", "offs"}:
            continue
        operands = [bound.kwargs[k] for k in ("input", "weight", "offs")]
        fakes = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in operands]
        if not all(isinstance(f, torch.Tensor) for f in fakes):
            continue
        try:
            grouped_mm_output(*fakes)
        except RuntimeError:
            continue  # the kernel's own checks refuse these operands: the fallback stays
        if not _kernel_runs(fakes[0].device, fakes[0].dtype):
            continue
        node.target = torch.ops.aten._grouped_mm.default
        node.args, node.kwargs = tuple(operands[:2]), {"offs": operands[2]}
        meta.invalidate(node)  # the real kernel pads rows to 16 bytes: the manager re-annotates
        done += 1
    if done:
        gm.recompile()
    return done


@functools.lru_cache(maxsize=None)
def _kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device has a `_grouped_mm` kernel for this dtype (CPU's since torch 2.9; CUDA's
    needs compute capability 8.0): one call on two rows."""
    try:
        a = torch.ones(2, 8, device=device, dtype=dtype)
        b = torch.ones(1, 8, 8, device=device, dtype=dtype)
        torch._grouped_mm(a, b.transpose(-2, -1), offs=torch.tensor([2], device=device, dtype=torch.int32))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True
