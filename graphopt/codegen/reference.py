"""The group as torch code: what runs on CPU tensors, and the oracle the repro scripts compare against.

It evaluates the same fp32 expressions as the kernels (program.py) on torch tensors, through the
torch stand-ins for triton.language that graphopt.ops.shim defines, with eager broadcasting:
1. forward(*inputs): inputs upcast to fp32, one line per step, the outputs' fp32 values (fp16/bf16
   steps rounded to their dtype, as in the kernels).
2. backward(*inputs, *grads): the forward code, adjoints seeded by the incoming gradients, each
   contribution summed down to its target's shape (as autograd reduces a broadcast) and rounded where
   the kernel rounds it (program.py, backward Step 5); the fp32 gradients of the inputs in
   program.grads.
The source is self-contained (it imports only torch), so a repro script can paste it.
"""
from __future__ import annotations

from ..ops.shim import FUNCTIONS
from .group import Group
from .program import Backward, forward_lines

PRELUDE = f'''import torch
from types import SimpleNamespace


def _tensors(f):
    return lambda *args: f(*(torch.as_tensor(a) for a in args))


# the triton.language functions the templates use, on torch tensors (as graphopt.ops.shim)
tl = SimpleNamespace(**{{name: _tensors(getattr(torch, name)) for name in {FUNCTIONS!r}}}, float32=torch.float32)


# fp32 rounded to the nearest fp16 / bf16, kept in fp32 (program.py: where eager rounds)
def round_fp16(x):
    return x.to(torch.float16).to(torch.float32)


def round_bf16(x):
    return x.to(torch.bfloat16).to(torch.float32)


def _sum_to(t, shape):
    """A contribution at its step's broadcast shape, summed down to its target's shape."""
    t = torch.as_tensor(t)
    return t.broadcast_to(torch.broadcast_shapes(t.shape, shape)).sum_to_size(shape)
'''


def _upcast(k: int) -> str:
    return f"x{k} = x{k}.to(torch.float32)"


def forward_function(group: Group, dtypes, name: str = "reference_forward") -> list[str]:
    params = ", ".join(f"x{k}" for k in range(len(group.inputs)))
    body = [_upcast(k) for k in range(len(group.inputs))]
    body += [f"{line.target} = {line.expr}  # {line.comment}" for line in forward_lines(group, dtypes)]
    body.append(f"return ({''.join(f'v{j}, ' for j in group.outputs)})")
    return [f"def {name}({params}):"] + ["    " + b for b in body]


def backward_function(group: Group, dtypes, program: Backward, name: str = "reference_backward") -> list[str]:
    params = [f"x{k}" for k in range(len(group.inputs))] + [f"g{i}" for i in range(len(group.outputs))]
    # the whole forward, not only the live code: every adjoint's reduction needs its step's shape
    body = [_upcast(k) for k in range(len(group.inputs))]
    body += [f"{line.target} = {line.expr}  # {line.comment}" for line in forward_lines(group, dtypes)]
    body += [f"{adjoint} = g{i}.to(torch.float32)" for adjoint, i in program.seeds]
    assigned = {adjoint for adjoint, _ in program.seeds}
    for c in program.contributions:
        shape = f"{'x' if c.of[0] == 'input' else 'v'}{c.of[1]}.shape"
        term = c.accumulate(f"_sum_to({c.term}, {shape})", c.target not in assigned)
        body.append(f"{c.target} = {term}  # {c.comment}")
        assigned.add(c.target)
    body.append(f"return ({''.join(f'd{k}, ' for k in program.grads)})")
    return [f"def {name}({', '.join(params)}):"] + ["    " + b for b in body]


def reference_source(group: Group, dtypes, program: Backward | None = None) -> str:
    """The prelude and reference_forward, plus reference_backward when `program` is given."""
    title = f"# graphopt fused reference (torch): {group.describe()}"
    lines = [title] + ([f"# from: {', '.join(group.origin)}"] if group.origin else [])
    lines += [PRELUDE, ""] + forward_function(group, dtypes)
    if program is not None:
        lines += ["", ""] + backward_function(group, dtypes, program)
    return "\n".join(lines) + "\n"
