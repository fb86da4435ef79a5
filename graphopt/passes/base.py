"""What a pass is: a name, declared options, and run(gm, ctx) -> PassResult.

Passes report what they did (and declined to do, and why) as data in `stats`; the pass
manager, the dumps and the report render it. Passes never print.

Metadata: nodes a pass creates are not annotated yet, and the manager then re-annotates the
graph by FakeTensor propagation. A pass that rewrites a node in place so that it computes
something else calls graphopt.analysis.meta.invalidate(node); one that keeps the result (a
respelling, a removal) leaves the metadata as it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
import torch.fx

from ..errors import OptionError


@dataclass
class PassResult:
    graph_module: torch.fx.GraphModule
    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)
    # Files for the dumps, by name: "kernels/..." go to the kernels directory, other names
    # next to the pass's own dump, as kk-name.<name>. A value may be a function returning
    # the content (or None for no file): it is called only when dumping.
    artifacts: dict[str, Any] = field(default_factory=dict)
    # What the result holds beyond its graph, for the manager and optimize(): the dtype the
    # graph now computes in (verification's tolerance), and why it holds only for the example
    # inputs' shapes (optimize() then installs a shape guard that says so).
    compute_dtype: torch.dtype | None = None
    specialized: str | None = None


@dataclass(frozen=True)
class Option:
    """One option of a pass: its default, how text is converted, and the values it accepts."""

    default: Any
    convert: Callable[[Any], Any]
    help: str
    choices: tuple | None = None


def _text(value) -> str:
    """An option value as pipeline text; an object (an optimizer) by its class."""
    return type(value).__name__ if isinstance(value, torch.optim.Optimizer) else str(value)


def positive(value) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError("must be a positive, finite number")
    return value


def count(value) -> int:
    """A whole number of at least 1."""
    value = int(value)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def to_bool(value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean (use true or false)")


def plans_memory_after(*names: str) -> dict[str, str]:
    """runs_after for a pass that plans memory: every pass that changes it must come first."""
    return {name: f"the plan is made for the memory of the graph it is given, which {name} changes"
            for name in names}


@dataclass
class PassContext:
    """Everything a pass may read besides the graph: the example inputs and the run's settings."""

    example_args: tuple
    example_kwargs: dict
    train: bool
    reference: torch.nn.Module | None = None  # the user's model, for verification
    microbatches: int | None = None  # the example inputs are one microbatch of this many
    # what the passes so far have made of the graph (the manager keeps these from PassResult)
    compute_dtype: torch.dtype = torch.float32
    specialized: str | None = None

    def flat_inputs(self, gm: torch.fx.GraphModule) -> list:
        from ..trace import placeholder_values

        return placeholder_values(gm, self.example_args, self.example_kwargs)


class Pass:
    """Base class: subclasses set `name`, `options` and `__doc__` (its algorithm, as numbered steps)."""

    name: ClassVar[str]
    options: ClassVar[dict[str, Option]] = {}
    # Passes that must run before this one when both are in a pipeline, each with the reason:
    # what they rewrite would change what this one decided (the pass manager checks it).
    runs_after: ClassVar[dict[str, str]] = {}
    # The optimize() arguments this pass takes, each with the option it sets. The first adds
    # the pass to the pipeline (optimize(budget_gb=8) adds recompute); the others refine it.
    arguments: ClassVar[dict[str, str]] = {}
    # Arguments that take this pass's place: given any, optimize() does not add this pass, and
    # its arguments go to the pass that argument adds (stages=: budget_gb caps each stage).
    yields_to: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check_arguments(cls, given: dict) -> None:
        """Raise OptionError for a combination of optimize() arguments this pass cannot take."""

    def microbatches_of(self, rows: int | None) -> int | None:
        """How many microbatches the run splits an example batch of `rows` rows into, when this
        pass runs the graph on microbatches; None (the default) when it does not."""
        return None

    def __init__(self, **options):
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            valid = ", ".join(sorted(self.options)) or "none"
            raise OptionError(f"pass {self.name!r} has no option {', '.join(map(repr, unknown))}; its options are: {valid}.")
        self.settings: dict[str, Any] = {}
        for key, opt in self.options.items():
            value = options.get(key, opt.default)
            if key in options and value is not None:
                try:
                    value = opt.convert(value)
                except (TypeError, ValueError) as e:
                    raise OptionError(f"pass {self.name!r}: bad value {options[key]!r} for option {key!r} ({opt.help}): {e}.") from None
            if opt.choices is not None and value not in opt.choices:
                raise OptionError(
                    f"pass {self.name!r}: option {key}={value!r} is not one of {', '.join(map(str, opt.choices))}."
                )
            self.settings[key] = value

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def spec(self) -> str:
        """The pass as pipeline text, e.g. 'cse' or 'precision{dtype=bf16}'."""
        changed = {k: v for k, v in self.settings.items() if v != self.options[k].default}
        if not changed:
            return self.name
        return f"{self.name}{{{','.join(f'{k}={_text(v)}' for k, v in changed.items())}}}"

    def __repr__(self) -> str:
        return f"<pass {self.spec()}>"
