"""A float64 step of a model whose ops include some without a float64 kernel.

verify's reference step and the corpus checks run a float64 copy of the model to see what float32
rounds away from. `torch._grouped_mm`, which transformers' mixture-of-experts layers run their
experts through, has kernels for float32, bfloat16 and float16 only; in float64 its groups are
computed here as the plain matmuls they are, differentiable, so backward needs nothing more.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> torch.Tensor:
    """torch._grouped_mm as its groups' matmuls: offs are the ends of the groups along the jagged
    dimension of the 2D operand(s); what lies past the last end is zeros (the kernel leaves it unset)."""
    ends = [] if offs is None else offs.tolist()
    spans = list(zip([0] + ends[:-1], ends))
    if mat_a.dim() == 3 and mat_b.dim() == 3:
        out = mat_a @ mat_b
    elif mat_a.dim() == 2 and mat_b.dim() == 2:  # groups split the contraction: one matrix each
        out = torch.stack([mat_a[:, s:e] @ mat_b[s:e] for s, e in spans])
    elif mat_a.dim() == 2:  # rows of mat_a by group, each times its group's matrix
        out = mat_a.new_zeros(mat_a.size(0), mat_b.size(-1))
        out = torch.cat([mat_a[s:e] @ mat_b[g] for g, (s, e) in enumerate(spans)] + [out[ends[-1]:]])
    else:  # columns of mat_b by group, each from its group's matrix of mat_a
        out = mat_a.new_zeros(mat_a.size(1), mat_b.size(-1))
        out = torch.cat([mat_a[g] @ mat_b[:, s:e] for g, (s, e) in enumerate(spans)] + [out[:, ends[-1]:]], dim=1)
    if bias is not None:
        out = out + bias
    return out if out_dtype is None else out.to(out_dtype)


class _Float64Ops(TorchFunctionMode):
    """Ops without a float64 kernel, given float64 inputs, computed from ones that have one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._grouped_mm and args and args[0].dtype == torch.float64:
            return grouped_mm(*args, **kwargs)
        return func(*args, **kwargs)


def runs_in_float64(module: torch.nn.Module) -> torch.nn.Module:
    """Hooks on a float64 copy of a model: its forward runs with _Float64Ops, entered by a pre-hook
    and left by a hook that runs even when forward raises, so the copy keeps its type and names."""
    mode = _Float64Ops()

    def enter(*_):  # a pre-hook's return value would replace forward's arguments: return nothing
        mode.__enter__()

    def leave(*_):
        mode.__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    return module
