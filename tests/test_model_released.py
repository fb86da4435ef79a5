"""What optimize() and train_step() return is all that keeps the model alive: dropped, the model's
parameters are freed (on a GPU, memory a process that optimizes model after model needs back)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import graphopt
from graphopt.testing import zoo


def _optimized(**settings):
    model, args, kwargs = zoo.gpt(batch=4, seq=16, layers=2)
    parameter = weakref.ref(next(model.parameters()))
    if settings.pop("train_step", False):
        graphopt.train_step(model, args, example_kwargs=kwargs, **settings)(*args, **kwargs)
    else:
        out = graphopt.optimize(model, args, example_kwargs=kwargs, **settings)(*args, **kwargs)
        out.loss.backward() if hasattr(out, "loss") else out.float().sum().backward()
    return parameter


@pytest.mark.parametrize("settings", [
    {"passes": "normalize"},  # the op lookups a pass asks
    {},  # the default passes
    {"budget_gb": 0.0015},  # recompute's fake steps and their saved-tensor hooks
    {"stages": 2},
    {"train_step": True, "budget_gb": 0.0015},
], ids=["lookups", "default", "budget", "stages", "train_step"])
def test_the_model_is_freed_once_the_result_is_dropped(settings, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # fuse's groups too
    parameter = _optimized(**settings)
    gc.collect()
    assert parameter() is None
