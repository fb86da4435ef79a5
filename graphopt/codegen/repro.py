"""Standalone repro scripts: a fused group's kernels on random inputs, against its torch reference.

The script pastes the forward and backward kernels and the torch reference (which imports only
torch), fixes the launch arguments for the given shapes, and runs on CUDA when there is one, else
in Triton's interpreter on CPU. It prints the largest error per tensor and exits 1 on a mismatch.
"""
from __future__ import annotations

import math

from .backward import KERNEL as BACKWARD
from .backward import backward_source
from .forward import KERNEL as FORWARD
from .forward import forward_source
from .group import Group
from .program import Backward
from .reference import reference_source
from .spec import LaunchPlan

TEMPLATE = '''"""graphopt fused-group repro: {title}
{origin}
Runs the generated Triton kernels on random inputs (on CUDA when available, else in Triton's
interpreter on CPU) and compares them with the same math evaluated by torch.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton.jit decorates the kernels

import triton
import triton.language as tl

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {shapes}
DTYPES = {dtypes}
N = {numel}
FULL = {full}
# relative and absolute tolerance per stored dtype: fp32 vs fp32 differs by the order of evaluation only
TOLERANCE = {{torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}}


{forward}

{backward}

# the same math on torch tensors; its own namespace, since its `tl` stands in for triton.language
REFERENCE = {reference!r}
reference = {{}}
exec(compile(REFERENCE, "reference", "exec"), reference)


def random(shape, dtype):
    if dtype == torch.bool:
        return torch.rand(shape, device=DEVICE) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-3, 4, shape, device=DEVICE, dtype=dtype)
    return torch.randn(shape, device=DEVICE).to(dtype)


def check(label, got, want):
    want = torch.empty_like(got).copy_(want)
    if got.dtype == torch.bool or not got.dtype.is_floating_point:
        ok = torch.equal(got, want)
        error = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    else:
        tol = TOLERANCE[got.dtype]
        ok = torch.allclose(got.double(), want.double(), rtol=tol, atol=tol, equal_nan=True)
        finite = torch.isfinite(want)
        error = float((got.double() - want.double())[finite].abs().max()) if finite.any() else 0.0
    print(f"{{label}}: {{'ok' if ok else 'MISMATCH'}} (max abs error {{error:.3g}})")
    return ok


def main():
    torch.manual_seed(0)
    block = 1024 if DEVICE == "cuda" else min(2**16, triton.next_power_of_2(N))
    grid = (triton.cdiv(N, block),)
    xs = [random(s, d) for s, d in zip(SHAPES, DTYPES)]
    outs = {outputs}
    {forward_kernel}[grid]({forward_args}, BLOCK=block)
    ok = all([check(f"output {{i}}", got, want) for i, (got, want) in enumerate(zip(outs, reference["reference_forward"](*xs)))])
{backward_main}
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
'''

BACKWARD_MAIN = '''    gs = {grads}
    buffers = {buffers}
    {backward_kernel}[grid]({backward_args}, BLOCK=block)
    got = [b.sum_to_size(SHAPES[k]).to(DTYPES[k]) for k, b in zip({grads_of}, buffers)]
    for k, g, want in zip({grads_of}, got, reference["reference_backward"](*xs, *gs)):
        ok &= check(f"gradient of input {{k}}", g, want)
'''


def _kernel_only(source: str) -> str:
    """A kernel's source without its imports (the script imports once)."""
    lines = source.splitlines()
    return "\n".join(line for line in lines if not line.startswith(("import triton", "import triton.language")))


def render(group: Group, plan: LaunchPlan, bplan: LaunchPlan, program: Backward, shapes, dtypes) -> str:
    outputs = [f"torch.empty({tuple(plan.shapes[j])}, dtype={plan.dtypes[j]}, device=DEVICE)" for j in group.outputs]
    forward_args = ([f"xs[{o.name[1:]}]" for o in plan.spec.operands if o.name.startswith("x")]
                    + [f"outs[{i}]" for i in range(len(group.outputs))] + [str(a) for a in plan.scalar_args()])
    reference = reference_source(group, plan.dtypes, program if program.grads else None)
    backward_main = backward = ""
    if program.grads:
        backward = _kernel_only(backward_source(group, bplan.spec, program))
        operands = {o.name: o for o in bplan.spec.operands}
        grads = ["None"] * len(group.outputs)
        for _, i in program.seeds:
            j = group.outputs[i]
            grads[i] = f"torch.randn({tuple(plan.shapes[j])}, device=DEVICE).to({plan.dtypes[j]})"
        buffers = [f"torch.empty({tuple(shapes[k]) if operands[f'd{k}'].dtype == dtypes[k] and math.prod(shapes[k]) == plan.layout.numel else 'FULL'}, "
                   f"dtype={operands[f'd{k}'].dtype}, device=DEVICE)" for k in program.grads]
        args = ([f"xs[{k}]" for k in program.inputs] + [f"gs[{i}]" for _, i in program.seeds]
                + [f"buffers[{m}]" for m in range(len(program.grads))] + [str(a) for a in bplan.scalar_args()])
        backward_main = BACKWARD_MAIN.format(grads=f"[{', '.join(grads)}]", buffers=f"[{', '.join(buffers)}]",
                                             backward_kernel=BACKWARD, backward_args=", ".join(args),
                                             grads_of=list(program.grads))
    return TEMPLATE.format(
        title=group.describe(), origin=f"from: {', '.join(group.origin)}" if group.origin else "",
        shapes=[tuple(s) for s in shapes], dtypes="[" + ", ".join(map(str, dtypes)) + "]",
        numel=plan.layout.numel, full=tuple(plan.full),
        forward=_kernel_only(forward_source(group, plan.spec, plan.dtypes)), backward=backward,
        reference=reference, outputs=f"[{', '.join(outputs)}]",
        forward_kernel=FORWARD, forward_args=", ".join(forward_args), backward_main=backward_main)

