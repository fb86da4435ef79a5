"""Evaluating Triton expression templates with torch, for checking them without a GPU.

`tl` here maps the triton.language functions the templates use onto torch, so a rendered template
can be eval'd on CPU tensors. The registry tests use it; the fusion pass's tests can too.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from .templates import render


def _tensors(f):
    # triton functions take python scalars as well as blocks
    return lambda *args: f(*(torch.as_tensor(a) for a in args))


FUNCTIONS = "exp log sqrt rsqrt abs sigmoid erf floor ceil sin cos maximum minimum where".split()
tl = SimpleNamespace(**{name: _tensors(getattr(torch, name)) for name in FUNCTIONS})


def evaluate(template: str, **values):
    """Render `template` with `values` (tensors or python scalars) and evaluate it with torch."""
    names = {k: f"_{k}" for k in values}
    scope = {"tl": tl, **{f"_{k}": v for k, v in values.items()}}
    return eval(render(template, **names), scope)
