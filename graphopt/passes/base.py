"""What a pass is: a name, its options (a frozen dataclass of option() fields), and
run(gm, ctx) -> PassResult.

Passes report what they did (and declined to do, and why) as data in `stats`; the pass
manager, the dumps and the report render it. Passes never print.

Metadata: nodes a pass creates are not annotated yet, and the manager then re-annotates the
graph by FakeTensor propagation. A pass that rewrites a node in place so that it computes
something else calls graphopt.analysis.meta.invalidate(node); one that keeps the result (a
respelling, a removal) leaves the metadata as it is.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch
import torch.fx

from ..analysis.cache import Analyses
from ..analysis.host_step import HostStep
from ..errors import OptionError
from ..frontend.graph_inputs import placeholder_values
from .options import Text, count, positive, to_bool  # noqa: F401  (the converters passes declare)
from .records import BudgetFit, MemoryCurves

if TYPE_CHECKING:
    from ..plan_cache.store import PlanStore


@dataclass
class PassResult:
    graph_module: torch.fx.GraphModule
    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)
    # Texts for the dumps, by name: "kernels/..." go to the kernels directory, other names
    # next to the pass's own dump, as kk-name.<name>.
    files: dict[str, str] = field(default_factory=dict)
    # The step's predicted memory through the pass, for the dumps to draw (recompute).
    memory: MemoryCurves | None = None
    # What the result holds beyond its graph, for the manager and optimize(): the dtype the
    # graph now computes in (verification's tolerance), and why it holds only for the example
    # inputs' shapes (optimize() then installs a shape guard that says so).
    compute_dtype: torch.dtype | None = None
    specialized: str | None = None
    # Checks a call of the optimized module must pass first, forward pre-hooks (with kwargs):
    # a rewrite decided at the example's sizes that other sizes must confirm. Each is decided by
    # the call's signature alone (structure, shapes, dtypes, devices): it runs once per signature.
    call_checks: list = field(default_factory=list)
    # A pass that planned memory for a budget: what it held the step to (train_step's fit check reads it).
    budget: BudgetFit | None = None
    # The step's predicted peak after the pass, where it estimated one (recompute, inplace): the report's.
    peak_bytes: int | None = None
    # A memory plan that runs the optimizer's step on the host (analysis/host_step.py): optimize()
    # installs it on the optimizer the plan was made for.
    host_step: HostStep | None = None


@dataclass(frozen=True)
class Option:
    """One option of a pass: its default, its converter, and the values it accepts.

    convert takes the value as given (Text when it comes from a pipeline string, else the
    Python object) and returns the setting, or raises ValueError saying what it must be: the
    converter optimize()'s record of the same option uses (options.py), so that an option is
    validated one way whether it comes from optimize(), a (name, options) pair or a pipeline
    string. spelled: its name there where the setting holds it in another unit (budget_gb for
    the bytes of budget_bytes), with shown turning the setting back into that unit."""

    default: Any
    convert: Callable[[Any], Any]
    help: str
    choices: tuple | None = None
    spelled: str | None = None
    shown: Callable[[Any], Any] | None = None


OPTION = "graphopt_option"  # the metadata key of an Options field's Option


def option(default, convert: Callable[[Any], Any], help: str, choices: tuple | None = None, *,
           spelled: str | None = None, shown: Callable[[Any], Any] | None = None):
    """A field of a pass's Options dataclass: its default, and the Option that validates it."""
    return field(default=default, metadata={OPTION: Option(default, convert, help, choices, spelled, shown)})


@dataclass(frozen=True)
class NoOptions:
    """The options of a pass that takes none."""


def _text(value) -> str:
    """An option value as pipeline text; an object (an optimizer) by its class."""
    return type(value).__name__ if isinstance(value, torch.optim.Optimizer) else str(value)


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
    cuda_graphs: bool = False  # the step is captured as CUDA graphs after the passes (runtime/cuda_graphs.py)
    plan_cache: PlanStore | None = None  # where the planning passes keep their outcomes; None: off
    # what the passes so far have made of the graph (the manager keeps these from PassResult)
    compute_dtype: torch.dtype = torch.float32
    specialized: str | None = None
    call_checks: list = field(default_factory=list)
    host_step: HostStep | None = None
    # what the other passes of the pipeline do, as the manager finds it from their declarations
    staged: bool = False           # one runs the graph as stages on microbatches (Pass.microbatches_of)
    units: bool = False            # one makes each repeated block a submodule (Pass.makes_units)
    writes_in_place: bool = False  # one writes elementwise ops in place (Pass.writes_in_place)
    analyses: Analyses = field(init=False, repr=False)

    def __post_init__(self):
        self.analyses = Analyses(self.flat_inputs)

    def flat_inputs(self, gm: torch.fx.GraphModule) -> list:
        return placeholder_values(gm, self.example_args, self.example_kwargs)

    def analysis(self, analysis, gm: torch.fx.GraphModule, **settings):
        """analysis(gm, the example inputs, **settings), computed once per version of gm
        (analysis/cache.py): a pass asks here for the facts other passes may have computed."""
        return self.analyses.get(analysis, gm, **settings)


class Pass:
    """Base class: subclasses set `name`, `Options` and `__doc__` (its algorithm, as numbered steps)."""

    name: ClassVar[str]
    # Its options: a frozen dataclass of option() fields, validated once as the pass is made
    # (self.settings is one); `options` lists their Options by the name a pipeline string
    # gives them, for parsing and help.
    Options: ClassVar[type] = NoOptions
    options: ClassVar[dict[str, Option]] = {}
    # Passes that must run before this one when both are in a pipeline, each with the reason:
    # what they rewrite would change what this one decided (the pass manager checks it).
    runs_after: ClassVar[dict[str, str]] = {}
    # A pass that plans memory for a budget: why in-place writes before it do not pay by default
    # (the inplace pass asks). None: it plans none.
    plans_memory: ClassVar[str | None] = None
    # It writes elementwise ops in place: a memory plan may then write within itself too.
    writes_in_place: ClassVar[bool] = False
    # It makes each repeated block a submodule: a recompute segment must then stay within a block.
    makes_units: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "options" in cls.__dict__:  # it would be replaced below, and its options lost without a word
            raise TypeError(f"pass {cls.__name__} declares `options`: declare them as fields of a frozen "
                            "dataclass of option() fields and set `Options = ThatClass`.")
        declared = {f.metadata[OPTION].spelled or f.name: f for f in dataclasses.fields(cls.Options)}
        cls.options = {key: f.metadata[OPTION] for key, f in declared.items()}
        cls._fields = {key: f.name for key, f in declared.items()}

    def skip_by_default(self, gm: torch.fx.GraphModule, ctx: PassContext, pipeline: list["Pass"]) -> str | None:
        """Why this pass, in the pipeline because optimize() was given no passes, does not pay on
        this graph (its device, the other passes of `pipeline`); None (the default) runs it."""
        return None

    def microbatches_of(self, rows: int | None) -> int | None:
        """How many microbatches the run splits an example batch of `rows` rows into, when this
        pass runs the graph on microbatches; None (the default) when it does not."""
        return None

    def __init__(self, **options):
        """options: the pass's options by the names a pipeline string gives them, each validated by
        its Option."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            valid = ", ".join(sorted(self.options)) or "none"
            raise OptionError(f"pass {self.name!r} has no option {', '.join(map(repr, unknown))}; its options are: {valid}.")
        self.by_default = False  # chosen by optimize() for a caller who named no passes
        self.settings = self.Options(**{self._fields[key]: self._setting(key, value) for key, value in options.items()})
        self.check_settings()

    @classmethod
    def with_settings(cls, settings) -> "Pass":
        """The pass with settings already checked (from optimize()'s record, OptimizeOptions: no
        second parse)."""
        made = cls.__new__(cls)
        made.by_default, made.settings = False, settings
        made.check_settings()
        return made

    def check_settings(self) -> None:
        """OptionError where the settings together leave the pass nothing to do (a precision pass
        without a precision); called however the pass is made."""

    def _setting(self, key: str, value):
        """The option's setting for value, or OptionError naming the pass's option."""
        opt = self.options[key]
        if value is None:  # not given: the option's default
            return opt.default
        try:
            setting = opt.convert(value)
            if opt.choices is not None and setting not in opt.choices:
                raise ValueError(f"must be one of {', '.join(map(str, opt.choices))}")
        except (TypeError, ValueError) as e:
            raise OptionError(f"pass {self.name!r}, option {key!r}: bad value {value!r} ({opt.help}): {e}.") from None
        return setting

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def spec(self) -> str:
        """The pass as pipeline text, e.g. 'cse' or 'precision{precision=bf16}'."""
        changed = {}
        for key, opt in self.options.items():
            value = getattr(self.settings, self._fields[key])
            if value != opt.default:
                changed[key] = opt.shown(value) if opt.shown is not None else value
        if not changed:
            return self.name
        return f"{self.name}{{{','.join(f'{k}={_text(v)}' for k, v in changed.items())}}}"

    def __repr__(self) -> str:
        return f"<pass {self.spec()}>"
