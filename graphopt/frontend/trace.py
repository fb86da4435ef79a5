"""Frontends that capture a model as a torch.fx graph, and FakeTensor annotation.

Two frontends:
  "fx"     torch.fx.symbolic_trace: a torch-level graph that keeps leaf modules
           (nn.Linear, nn.BatchNorm2d, ...) as call_module nodes.
  "export" torch.export.export(strict=False).module(): an ATen-level graph that captures
           what fx cannot (data-dependent Python, HF models), still trainable.
"auto" tries fx first and falls back to export.

Annotation runs the graph on FakeTensors (shapes only, no memory) and records a
TensorInfo on every tensor-producing node: a model larger than the machine's memory traces.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import traceback
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .. import ops
from ..analysis import fake_kernels
from ..analysis import meta
from ..analysis.dispatched import DISPATCHED, recording, summary
from ..analysis.fake_state import fake_run
from ..analysis.planning_device import meta_literals_on_cpu, planning_device
from ..errors import SizeError, TraceError, UsageError
from . import custom_functions, export_batch
from .fx_state import StateWatch, Unreplayable, check_write_backs
from .graph_inputs import placeholder_values, register_dataclasses
from .input_aliases import distinct

FRONTENDS = ("auto", "fx", "export")

_ADVICE = (
    "What you can do: check that example_inputs and example_kwargs match the model's forward() "
    "signature and run in eager mode; keep Python control flow from depending on tensor values "
    "(or try frontend='export'); register custom output classes with "
    "torch.utils._pytree.register_dataclass."
)


_TORCH_DIR = os.path.dirname(torch.__file__)


class _Tracer(torch.fx.Tracer):
    """symbolic_trace's tracer, recording where each node came from for the dumps.

    Buffers read in forward are proxies too (get_attr nodes), so what forward does to them
    (`self.ema.mul_(0.9)`, `self.steps += 1`) is recorded, not run once at trace time.
    """

    proxy_buffer_attributes = True

    def __init__(self):
        super().__init__()
        self.record_stack_traces = True
        self._names: dict[int, str] | None = None  # id of each parameter and buffer -> its first name

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        # torch's getattr scans every named parameter and buffer for each one a forward reads,
        # quadratic in the model's tensors (most of a large convnet's trace); names found by
        # identity once answer the same where the name still holds the tensor, and torch's scan
        # answers the rest (a tensor assigned during forward).
        if isinstance(attr_val, torch.Tensor) and not self.param_shapes_constant and (
                isinstance(attr_val, torch.nn.Parameter) or self.proxy_buffer_attributes):
            if self._names is None:
                self._names = {}
                for name, t in [*self.root.named_parameters(), *self.root.named_buffers()]:
                    self._names.setdefault(id(t), name)
            name = self._names.get(id(attr_val))
            if name is not None and self._holds(name, attr_val):
                if name not in parameter_proxy_cache:
                    parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
                return parameter_proxy_cache[name]
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def _holds(self, name: str, value: torch.Tensor) -> bool:
        """Whether the root's parameter (for a Parameter) or buffer `name` is value now, read from
        the modules' own dicts: fx routes Module.__getattr__ through this tracer while it traces."""
        *path, leaf = name.split(".")
        module = self.root
        for part in path:
            module = module._modules.get(part)
            if module is None:
                return False
        table = module._parameters if isinstance(value, torch.nn.Parameter) else module._buffers
        return table.get(leaf) is value

    def _filter_traceback_frames(self, summary: traceback.StackSummary) -> traceback.StackSummary:
        # fx keeps its own frames, so the dumps would name torch/fx/proxy.py as every node's
        # source; keep only the frames of the model's code, below graphopt's call to trace (and
        # above this tracer's getattr, from which a parameter's node is made).
        start = max((i + 1 for i, f in enumerate(summary) if f.filename == __file__ and f.name != "getattr"),
                    default=0)
        frames = [f for f in list(summary)[start:] if not f.filename.startswith(_TORCH_DIR) and f.filename != __file__]
        return traceback.StackSummary.from_list(frames)


def check_inputs(model, example_inputs, example_kwargs) -> tuple[tuple, dict]:
    """Normalize example inputs to (args, kwargs) or raise a UsageError that says how to pass them."""
    if not isinstance(model, torch.nn.Module):
        raise UsageError(
            f"graphopt needs a torch.nn.Module, got {type(model).__name__}; wrap a plain function "
            "in an nn.Module whose forward() calls it."
        )
    if example_inputs is None:
        args: tuple = ()
    elif isinstance(example_inputs, torch.Tensor):
        args = (example_inputs,)
    elif isinstance(example_inputs, (tuple, list)):
        args = tuple(example_inputs)
    else:
        raise UsageError(
            f"example_inputs must be a tensor or a tuple of forward()'s positional arguments, "
            f"got {type(example_inputs).__name__}; pass keyword arguments as example_kwargs={{...}}."
        )
    if example_kwargs is None:
        kwargs: dict = {}
    elif isinstance(example_kwargs, dict):
        kwargs = dict(example_kwargs)
    else:
        raise UsageError(f"example_kwargs must be a dict of forward()'s keyword arguments, got {type(example_kwargs).__name__}.")
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise UsageError(
            f"example inputs do not fit {type(model).__name__}.forward{inspect.signature(model.forward)}: {e}. "
            "Pass one example value for each argument forward() needs."
        ) from None
    return args, kwargs


def _trace_fx(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    sig = inspect.signature(model.forward)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
        raise TraceError("forward(*args, **kwargs) has no fixed signature for fx placeholders")
    bound = sig.bind(*args, **kwargs)
    # Arguments the user left at their default are baked in (fx guards each with an assert),
    # so that `if mask is not None:` traces instead of failing on a Proxy.
    concrete = {name: p.default for name, p in sig.parameters.items() if name not in bound.arguments}
    with StateWatch(model) as watch, custom_functions.keeping("fx"):
        graph = _Tracer().trace(model, concrete_args=concrete or None)
        watch.write_back(graph)
    gm = torch.fx.GraphModule(model, graph, class_name=type(model).__name__)
    _share_structure(gm, model)
    return gm


def _share_structure(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """Make gm hold the model's own submodules, parameters and buffers.

    fx copies only the attributes the graph uses, into fresh container modules; putting the
    original children back keeps every Parameter shared and state_dict keys equal to the
    model's (unused ones included), while every graph target still resolves.
    """
    for name, child in model.named_children():
        setattr(gm, name, child)
    for name, p in model.named_parameters(recurse=False):
        gm.register_parameter(name, p)
    for name, b in model.named_buffers(recurse=False):
        gm.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)


def _trace_export(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    exports = export_batch.kept_exports()  # an earlier export whose dynamic sizes take these inputs
    kept = exports.get(model, args, kwargs) if exports is not None else None
    gm = kept[0].module() if kept is not None else None
    if gm is not None and export_batch.guards_failure(gm, args, kwargs) is None:
        _, sizes, static_why = kept
    else:
        with StateWatch(model, refuse=False), _registering_outputs(model), custom_functions.keeping("export"):
            ep, sizes, static_why = export_batch.export(model, args, kwargs)
        gm = ep.module()
        custom_functions.restore(gm)
        if exports is not None:
            exports.put(model, args, kwargs, ep, sizes, static_why)
    gm.meta["graphopt_sizes"] = sizes  # the sizes the graph takes other values of; None: the example's only
    gm.meta["graphopt_batch"] = sizes.batch if sizes is not None else None  # the batch sizes it runs at
    gm.meta["graphopt_static_why"] = static_why
    # ExportedProgram.module() makes train()/eval() raise NotImplementedError. graphopt lets the
    # flag change like on any module and its mode guard explains the problem at call time.
    gm.__dict__.pop("train", None)
    gm.__dict__.pop("eval", None)
    gm.train(model.training)  # module() reports training=True whatever mode the graph was captured in
    return gm


@contextlib.contextmanager
def _registering_outputs(model: torch.nn.Module):
    """export flattens outputs with pytree, which must know each dataclass the model returns: a
    forward hook registers each unknown one (as torch.export asks users to do by hand) as export's
    own run of forward returns it, before it flattens it."""
    handle = model.register_forward_hook(lambda module, inputs, out: register_dataclasses(out))
    try:
        yield
    finally:
        handle.remove()


class _Annotator(FakeTensorProp):
    """FakeTensorProp, recording each node's TensorInfo from its live result: meta["val"] is a
    detached snapshot, which would say no tensor requires grad. A call the registry does not list
    runs while the operators it dispatches are recorded (analysis/dispatched.py)."""

    def run_node(self, n: torch.fx.Node):
        if n.op in ("call_function", "call_method", "call_module") and ops.lookup(n, self.module) is None:
            with recording() as recorder:
                result = super().run_node(n)
            n.meta[DISPATCHED] = summary(recorder)
        else:
            result = super().run_node(n)
        meta.record(n, result)
        n.meta[meta.ANNOTATED] = True
        return result


def annotate(gm: torch.fx.GraphModule, flat_inputs: list) -> list[str]:
    """Record a TensorInfo on every node by running the graph on FakeTensors; return the
    placeholders the run wrote in place (their fakes' version counters moved), the model's
    own writes into its arguments, measured whatever op makes them."""
    for node in gm.graph.nodes:
        node.meta.pop(meta.ANNOTATED, None)
    with fake_run(gm, flat_inputs) as (mode, fake_inputs), torch.enable_grad():
        versions = [t._version if isinstance(t, torch.Tensor) else None for t in fake_inputs]
        _Annotator(gm, mode).propagate_dont_convert_inputs(*fake_inputs)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return [name for name, t, v in zip(placeholders, fake_inputs, versions) if v is not None and t._version != v]


_FRONTENDS = {"fx": _trace_fx, "export": _trace_export}


def trace(
    model: torch.nn.Module,
    example_inputs: Any = None,
    example_kwargs: dict | None = None,
    frontend: str = "auto",
) -> torch.fx.GraphModule:
    """Capture `model` as a GraphModule whose nodes carry shape, dtype, device, stride and bytes.

    The GraphModule shares the model's Parameters and buffers and takes the same arguments.
    Inputs that share storage are traced as distinct tensors (input_aliases.py); the graph's
    meta["graphopt_written_inputs"] names the placeholders the model writes in place. Inside
    export_batch.keeping_exports, an earlier export whose dynamic sizes take these inputs is
    used again.
    Raises TraceError with each frontend's reason when none can capture the model.
    """
    if frontend not in FRONTENDS:
        from ..errors import OptionError

        raise OptionError(f"unknown frontend {frontend!r}; choose one of {', '.join(FRONTENDS)}.")
    args, kwargs = distinct(*check_inputs(model, example_inputs, example_kwargs))
    order = ("fx", "export") if frontend == "auto" else (frontend,)
    reasons: dict[str, str] = {}
    for name in order:
        try:
            with fake_kernels.active():  # export and annotation run ops on FakeTensors
                gm = _FRONTENDS[name](model, args, kwargs)
                if planning_device() is not None:  # a meta model planned for a device (graphopt.plan)
                    meta_literals_on_cpu(gm)
                written = annotate(gm, placeholder_values(gm, args, kwargs))
            check_write_backs(gm)
        except SizeError:  # the example itself is past the model's limit: no frontend takes it
            raise
        except Exception as e:  # each frontend's failure is reported, the next one tried
            reasons[name] = str(e) if isinstance(e, TraceError) else _first_line(e)
            if isinstance(e, Unreplayable):
                break
            continue
        gm.meta["graphopt_frontend"] = name
        gm.meta["graphopt_training"] = model.training
        gm.meta["graphopt_written_inputs"] = written
        return gm
    raise TraceError(
        f"graphopt could not trace {type(model).__name__} with the given example inputs "
        f"(frontend={frontend!r}). {_ADVICE}{_VALUE_SHAPES if _shapes_follow_values(reasons) else ''} "
        "Each frontend's reason:",
        reasons,
    )


# Shapes that follow tensor values: a graph and its memory plan are for the shapes of a batch,
# so graphopt takes no model whose sizes its values decide (per-expert loops route by value).
_VALUE_SHAPES = (
    " The model makes tensors whose shapes depend on tensor values (nonzero, boolean masks, a loop "
    "over the experts a router chose), which no graph planned for a batch's shapes can hold for "
    "every batch: for transformers' mixture-of-experts models use their grouped experts "
    "(experts_implementation='grouped_mm', the default), whose shapes the batch alone decides."
)


def _shapes_follow_values(reasons: dict[str, str]) -> bool:
    return any(k in r for r in reasons.values() for k in ("DynamicOutputShapeException", "data-dependent",
                                                          "GuardOnDataDependentSymNode"))


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    lines = [ln for ln in text.splitlines() if ln.strip()]
    head = " ".join(lines[:3])
    return f"{type(e).__name__}: {head[:400]}"
