"""The precisions graphopt speaks of and their dtypes: one vocabulary for optimize(), the
command line, the precision pass, its analysis and the reports."""
from __future__ import annotations

import torch

PRECISIONS = ("bf16", "fp16", "fp32")  # what optimize(precision=...) and --precision take
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}  # what the precision pass lowers to
_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
          "fp32": "fp32", "float32": "fp32", "float": "fp32",
          torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def precision_name(value) -> str | None:
    """The precision a name or dtype spells (bfloat16, torch.half, "FP16", ...); None if none."""
    try:
        return _NAMES.get(value.strip().lower() if isinstance(value, str) else value)
    except TypeError:  # unhashable: no precision's name
        return None


def low_precision(value) -> str:
    """The low precision a name or dtype spells, bf16 or fp16; ValueError for any other."""
    name = precision_name(value)
    if name not in LOW:
        raise ValueError(f"use {' or '.join(sorted(LOW))}; fp32 computes as the model does, with no precision pass")
    return name


def short(dtype: torch.dtype) -> str:
    """bf16, fp16, fp32, fp64; torch's own name for any other dtype."""
    return _SHORT.get(dtype, torch_name(dtype))


def torch_name(dtype: torch.dtype) -> str:
    """torch's name for the dtype, without the module: float32, bfloat16, int64."""
    return str(dtype).replace("torch.", "")
