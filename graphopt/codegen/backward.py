"""The backward Triton kernel of a fused group: all input gradients in one pass.

1. Scaffolding (kernel.py), and loads of the inputs the live forward code reads.
2. The live forward code, recomputed instead of saved (program.backward_program).
3. Incoming gradients seed their output's adjoint. An output smaller than the full shape has its
   gradient loaded only at index 0 of the dims it is broadcast along, so that summing the input
   gradients over the full shape counts each of its elements once.
4. The contributions in reverse step order, each added to its arg's adjoint, both rounded to fp16/bf16
   where eager's autograd materializes them so (program.py, backward Step 5).
5. Each input's gradient is stored at the full shape: in the input's dtype when the input spans the
   full shape, in fp32 otherwise (the runtime sums it down to the input's shape).
"""
from __future__ import annotations

from .group import Group
from .kernel import header, indent, index, load, module, kernel_signature, store
from .program import Backward
from .spec import Spec

KERNEL = "fused_backward"


def backward_source(group: Group, spec: Spec, program: Backward) -> str:
    by_name = {o.name: o for o in spec.operands}
    body = index(spec)
    body += [load(by_name[f"x{k}"]) for k in program.inputs]
    body += [f"{line.target} = {line.expr}  # {line.comment}" for line in program.forward]
    for adjoint, i in program.seeds:
        dims = spec.mask_dims(i)
        mask = " & ".join(["mask"] + [f"(i{d} == 0)" for d in dims])
        if dims:
            body.append(f"# output {i} is broadcast along dims {dims}: count its gradient once")
        body.append(load(by_name[f"g{i}"], mask, ", other=0.0" if dims else ""))
        body.append(f"{adjoint} = g{i}")
    assigned = {adjoint for adjoint, _ in program.seeds}
    for c in program.contributions:
        body.append(f"{c.target} = {c.accumulate(c.term, c.target not in assigned)}  # {c.comment}")
        assigned.add(c.target)
    body += [store(by_name[f"d{k}"], f"d{k}") for k in program.grads]
    title = f"gradients of inputs {list(program.grads)} of {group.describe()}"
    return module(header(title, group.origin, spec), kernel_signature(KERNEL, spec) + indent(body))
