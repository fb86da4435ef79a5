"""fuse: elementwise and row ops into generated Triton kernels (fuse_pass.py, its algorithm),
with the analyses only it asks (which groups, which rows, what a group outputs) beside it."""
from .fuse_pass import Fuse

__all__ = ["Fuse"]
