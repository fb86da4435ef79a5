"""The module optimize() returns without example inputs: it optimizes on its first call.

It owns the model's submodules, parameters and buffers directly (the same dicts, not
copies), so parameters(), state_dict() keys and optimizers see exactly the model's.
A call with a new input signature or train/eval mode first tries the graphs already built for
that mode, newest first: one whose checks take the call (runtime/guards.refusal: sizes export
kept dynamic, a budget plan whose estimate fits at these sizes, causal masks) serves it, so a
loader's shorter sequences run on the plan made for a longer one. Else a new graph is built,
once, by `build(model, args, kwargs, dump_dir=...)`: api's optimize_now with the pipeline and
settings optimize() checked, which exports the model again only where no program it exported
before takes the call's sizes (export_batch.ExportCache); each build after the first dumps into
dump_dir/build-K. At most MAX_GRAPHS graphs are kept, the least recently used dropped first.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch

from ..frontend.call_signature import signature
from ..frontend.export_batch import ExportCache, keeping_exports
from .guards import refusal, refused_save

MAX_GRAPHS = 8  # graphs kept; a plan holds no tensors, but each graph its generated code
MAX_SIGNATURES = 1024  # signatures remembered, the least recently used forgotten first


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
        self.__dict__["_built"] = OrderedDict()  # (signature, training) -> graph that runs it
        self.__dict__["_graphs"] = OrderedDict()  # id -> (graph, training, signature without shapes)
        self.__dict__["_builds"] = 0
        self.__dict__["_exports"] = ExportCache(MAX_GRAPHS)  # a new length's plan needs no new export
        self.__dict__["_last"] = None
        self.training = model.training

    def forward(self, *args, **kwargs):
        key = (signature(args, kwargs), self.training)
        gm = self._built.get(key)
        if gm is None:
            gm = self._reusable(args, kwargs) or self._new(args, kwargs)
        self._remember(key, gm)
        self.__dict__["_last"] = gm
        return gm(*args, **kwargs)

    def _reusable(self, args: tuple, kwargs: dict) -> torch.fx.GraphModule | None:
        """The newest graph of this mode whose checks take this call."""
        kinds = signature(args, kwargs, shapes=False)
        for gm, training, built_for in reversed(self._graphs.values()):
            if training == self.training and built_for == kinds and refusal(gm, args, kwargs) is None:
                return gm
        return None

    def _new(self, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
        dump_dir = self._dump_dir
        if dump_dir and self._builds:
            dump_dir = os.path.join(dump_dir, f"build-{self._builds + 1}")
        self._model.train(self.training)
        with keeping_exports(self._exports):
            gm = self._build(self._model, args, kwargs or None, dump_dir=dump_dir)
        self.__dict__["_builds"] = self._builds + 1
        self._graphs[id(gm)] = (gm, self.training, signature(args, kwargs, shapes=False))
        while len(self._graphs) > MAX_GRAPHS:
            _, (dropped, _, _) = self._graphs.popitem(last=False)
            for k in [k for k, g in self._built.items() if g is dropped]:
                del self._built[k]
        return gm

    def _remember(self, key, gm: torch.fx.GraphModule) -> None:
        self._built[key] = gm
        self._built.move_to_end(key)
        self._graphs.move_to_end(id(gm))
        while len(self._built) > MAX_SIGNATURES:
            self._built.popitem(last=False)

    def __reduce_ex__(self, protocol):
        raise refused_save()

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
        return f"optimizing {type(self._model).__name__}; {self._builds} graph(s) built, {len(self._graphs)} kept"
