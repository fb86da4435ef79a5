"""The module optimize() returns without example inputs: it optimizes on its first call.

It owns the model's submodules, parameters and buffers directly (the same dicts, not
copies), so parameters(), state_dict() keys and optimizers see exactly the model's.
Each new input signature or train/eval mode gets its own optimized graph, built once, by
`build(model, args, kwargs, dump_dir=...)`: api's optimize_now with the pipeline and settings
optimize() checked; each build after the first dumps into dump_dir/build-K.
"""
from __future__ import annotations

import os

import torch

from .errors import UsageError
from .runtime.guards import SAVE_ADVICE, signature


class LazyOptimized(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, build, dump_dir: str | None):
        super().__init__()
        # Share, not register: registering `model` as a child would prefix every state_dict key.
        self.__dict__["_model"] = model
        self.__dict__["_modules"] = model._modules
        self.__dict__["_parameters"] = model._parameters
        self.__dict__["_buffers"] = model._buffers
        self.__dict__["_non_persistent_buffers_set"] = model._non_persistent_buffers_set
        self.__dict__["_build"] = build
        self.__dict__["_dump_dir"] = dump_dir
        self.__dict__["_built"] = {}
        self.__dict__["_last"] = None
        self.training = model.training

    def forward(self, *args, **kwargs):
        key = (signature(args, kwargs), self.training)
        gm = self._built.get(key)
        if gm is None:
            dump_dir = self._dump_dir
            if dump_dir and self._built:
                dump_dir = os.path.join(dump_dir, f"build-{len(self._built) + 1}")
            self._model.train(self.training)
            gm = self._build(self._model, args, kwargs or None, dump_dir=dump_dir)
            self._built[key] = gm
        self.__dict__["_last"] = gm
        return gm(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        raise UsageError(SAVE_ADVICE)

    @property
    def graph_module(self) -> torch.fx.GraphModule | None:
        """The optimized graph of the most recent call (None before the first)."""
        return self._last

    @property
    def graphopt_report(self):
        return None if self._last is None else self._last.graphopt_report

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_model"], name)

    def extra_repr(self) -> str:
        return f"optimizing {type(self._model).__name__}; {len(self._built)} graph(s) built"
