"""Small fused groups on meta tensors, the groups the codegen tests plan and render."""
import torch

from graphopt.codegen import Group, Step

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def meta(*shape, dtype=F32, strides=None):
    if strides is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.empty_strided(shape, strides, dtype=dtype, device="meta")


def chain(*ops, inputs=1):
    """op0(input 0 [, input 1]) -> op1 -> ...: the first op takes all inputs."""
    steps = [Step(ops[0], tuple(("input", k) for k in range(inputs)))]
    steps += [Step(op, (("step", j),)) for j, op in enumerate(ops[1:])]
    return Group([f"x{k}" for k in range(inputs)], steps, [len(steps) - 1], origin=[f"node_{op}" for op in ops])
