"""A graph's inputs and outputs as a call gives and takes them: the values its placeholders take
for a call, and the model's output dataclasses registered with pytree. What the runtime needs of
the frontend at every call, apart from tracing itself."""
from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.fx
import torch.utils._pytree as pytree


def program_inputs(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The values the placeholders of an exported program's module take for a call: the pytree
    leaves of (args, kwargs), flattened by the program's input spec."""
    import torch.fx._pytree as fx_pytree

    return list(fx_pytree.tree_flatten_spec((args, kwargs), gm._in_spec))


def _register_cache(value) -> bool:
    """Register a transformers cache (DynamicCache, EncoderDecoderCache, ...) that a model
    returns at its default use_cache=True, with transformers' own pytree functions for export;
    False when this is not one or transformers has none."""
    cls = type(value)
    if not (cls.__module__.startswith("transformers.") and cls.__name__.endswith("Cache")):
        return False
    try:
        from transformers.exporters.exporter_dynamo import register_pytree_node
    except ImportError:
        return False
    if cls not in pytree.SUPPORTED_NODES:
        register_pytree_node(cls)
    return True


def register_dataclasses(value) -> None:
    """Register with pytree every dataclass type found in value (nested in containers too), and
    the transformers caches among them."""
    if _register_cache(value):
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if type(value) not in pytree.SUPPORTED_NODES:
            torch.export.register_dataclass(type(value))
        for f in dataclasses.fields(value):
            register_dataclasses(getattr(value, f.name))
    elif isinstance(value, (list, tuple)):
        for v in value:
            register_dataclasses(v)
    elif isinstance(value, dict):
        for v in value.values():
            register_dataclasses(v)


def placeholder_values(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The values the graph's placeholders take for a call gm(*args, **kwargs), in order."""
    if getattr(gm, "_in_spec", None) is not None:  # export: placeholders are the pytree leaves of (args, kwargs)
        return program_inputs(gm, args, kwargs)
    sig = inspect.signature(gm.forward)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return [bound.arguments[n.target] for n in gm.graph.nodes if n.op == "placeholder"]
