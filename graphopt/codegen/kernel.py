"""The Triton scaffolding every generated kernel shares: kernel_signature, flat index, unravel, loads, stores.

1. Signature: one pointer per tensor, n, the sizes the unravel divides by, the strides, BLOCK.
2. offs = pid * BLOCK + arange(BLOCK), masked by offs < n; pid is widened first when offsets are 64-bit.
3. The merged dims' indices are peeled off offs from the innermost dim out, only as far as needed.
4. A tensor's offset is offs when it is flat, else the dot of the indices with its strides (unit
   strides are folded in, broadcast dims left out). Loads upcast to fp32; stores cast to the
   tensor's dtype.
"""
from __future__ import annotations

import os

import torch

from .spec import Operand, Spec

TL = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.bool: "tl.int1",
      torch.uint8: "tl.uint8", torch.int8: "tl.int8", torch.int16: "tl.int16", torch.int32: "tl.int32",
      torch.int64: "tl.int64"}
INDENT = "    "


def header(title: str, origin, spec: Spec) -> list[str]:
    lines = [f"# graphopt fused {spec.kind}: {title}"]
    if origin:
        lines.append(f"# from: {', '.join(origin)}")
    described = ", ".join(f"{o.name} {str(o.dtype).replace('torch.', '')} {_pattern(o.pattern)}" for o in spec.operands)
    lines.append(f"# tensors: {described}")
    lines.append(f"# merged rank {spec.rank}, {'int64' if spec.index64 else 'int32'} offsets")
    return lines + ["import triton", "import triton.language as tl", "", ""]


def _pattern(p) -> str:
    return "flat" if p == "flat" else "[" + ",".join(map(str, p)) + "]"


def kernel_signature(name: str, spec: Spec) -> list[str]:
    params = [f"{o.name}_ptr" for o in spec.operands] + ["n"]
    params += [f"size{d}" for d in spec.size_params()]
    params += [f"{spec.operands[k].name}_stride{d}" for k, d in spec.stride_params()]
    return ["@triton.jit", f"def {name}({', '.join(params)}, BLOCK: tl.constexpr):"]


def index(spec: Spec) -> list[str]:
    pid = "tl.program_id(0).to(tl.int64)" if spec.index64 else "tl.program_id(0)"
    lines = [f"offs = {pid} * BLOCK + tl.arange(0, BLOCK)", "mask = offs < n"]
    dims = spec.unravel()
    if dims:
        lines.append("# indices over the merged shape, innermost first")
        rest = "offs"
        for d in range(spec.rank - 1, dims[0] - 1, -1):
            if d == 0:
                lines.append(f"i0 = {rest}")
                break
            if d in dims:
                lines.append(f"i{d} = {rest} % size{d}")
            if d > dims[0]:
                lines.append(f"q{d} = {rest} // size{d}")
                rest = f"q{d}"
    return lines


def offset(o: Operand) -> str:
    if o.pattern == "flat":
        return "offs"
    terms = [f"i{d}" if v == 1 else f"i{d} * {o.name}_stride{d}" for d, v in enumerate(o.pattern) if v != 0]
    return " + ".join(terms) if terms else "0 * offs"  # broadcast everywhere: one element, loaded by every lane


def load(o: Operand, mask: str = "mask", other: str = "") -> str:
    value = f"tl.load({o.name}_ptr + {offset(o)}, mask={mask}{other})"
    return f"{o.name} = {value}" + ("" if o.dtype == torch.float32 else ".to(tl.float32)")


def store(o: Operand, value: str) -> str:
    if o.dtype == torch.bool:
        value = f"{value} != 0"
    elif o.dtype == torch.bfloat16:
        value = f"round_bf16({value}).to(tl.bfloat16)"
    elif o.dtype != torch.float32:
        value = f"{value}.to({TL[o.dtype]})"
    return f"tl.store({o.name}_ptr + {offset(o)}, {value}, mask=mask)"


# fp32 rounded to the nearest fp16 / bf16 (ties to even), kept in fp32: program.py rounds where eager does
HELPERS = {"round_fp16": """@triton.jit
def round_fp16(x):
    return x.to(tl.float16).to(tl.float32)


""", "round_bf16": """@triton.jit
def round_bf16(x):
    return x.to(tl.bfloat16).to(tl.float32)


"""}
# Triton's interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even (one instruction):
# under the interpreter bf16 is rounded by hand, so that both give torch's result. A NaN stays one.
INTERPRETED_HELPERS = {**HELPERS, "round_bf16": """@triton.jit
def round_bf16(x):
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return tl.where(x == x, ((bits >> 16) << 16).to(tl.float32, bitcast=True), x)


"""}


def module(head: list[str], kernel: list[str]) -> str:
    """A kernel module's source: the rounding helpers it uses precede the kernel."""
    text = "\n".join(kernel) + "\n"
    helpers = INTERPRETED_HELPERS if os.environ.get("TRITON_INTERPRET") == "1" else HELPERS
    return "\n".join(head) + "\n" + "".join(h for name, h in helpers.items() if f"{name}(" in text) + text


def indent(lines) -> list[str]:
    return [INDENT + line if line else line for line in lines]
