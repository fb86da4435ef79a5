"""Triton source generation for fused groups of elementwise ops (the IR, the kernels, the torch reference).

group.py: the Group IR, its dtypes and what is declined; layout.py: broadcast/stride analysis;
program.py: the fp32 straight-line code, forward and reverse mode; kernel.py, forward.py, backward.py:
the Triton kernels; reference.py: the same code on torch tensors; spec.py: kernel keys and launch
arguments; compile.py: source to module; repro.py: standalone repro scripts. row_group.py,
row_program.py, row_kernel.py, row_launch.py: groups that also reduce over the last dim (norms,
softmax), tiles of rows per program, persistent or looped over column chunks, and their launches.
"""
from .group import Group, Input, Step, Unsupported, step_dtypes, step_shapes, supports

__all__ = ["Group", "Input", "Step", "Unsupported", "step_dtypes", "step_shapes", "supports"]
