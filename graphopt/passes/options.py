"""optimize()'s options that ask for passes: one typed record the passes read under the same
names, and the converter of each option.

    optimize(model, x, budget_gb=8, precision="bf16")
      -> api.checked_options(budget_gb=8, precision="bf16")          each value checked at the entry, once
      -> OptimizeOptions(budget_bytes=8_000_000_000, precision="bf16") bytes from here on
      -> Recompute.from_options(options), Precision.from_options(options)  (api.build_pipeline)

Each option's converter here is the one its pass's own option uses for a pipeline string
('recompute{budget_gb=8}'): one check per option, whichever way it comes in.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

from ..analysis.autocast_plan import MODES, parse_policy
from ..analysis.optimizer_memory import NAMED, check_optimizer
from ..vocabulary.precisions import low_precision, precision_name
from ..vocabulary.sizes import budget_bytes

SHARD_STYLES = ("fsdp",)  # how shard= cuts the model: FSDP2 units per repeated block


class Text(str):
    """An option's value as written in a pipeline string ('recompute{budget_gb=8}'): converters
    parse it, where a Python value must already be of the option's type (budget_gb='8' is not
    a number)."""


def _number(value, kind: type, parse: Callable[[str], Any], what: str):
    if isinstance(value, Text):
        try:
            return parse(value)
        except ValueError:
            raise ValueError(f"must be {what}") from None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"must be {what}")
    return value


def positive(value) -> float:
    """A positive, finite real number (not a bool)."""
    what = "a positive, finite number"
    value = float(_number(value, numbers.Real, float, what))
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"must be {what}")
    return value


def budget_in_bytes(value) -> int:
    """budget_gb as the bytes every pass and check reads: a positive, finite number of GB of
    10**9 bytes, converted here once."""
    return budget_bytes(positive(value))


def count(value) -> int:
    """A whole number of at least 1 (2.0 is not one)."""
    value = int(_number(value, numbers.Integral, int, "a whole number, at least 1"))
    if value < 1:
        raise ValueError("must be a whole number, at least 1")
    return value


def to_bool(value) -> bool:
    """True or False; in a pipeline string also 1/0, yes/no, on/off."""
    if isinstance(value, bool):
        return value
    text = value.strip().lower() if isinstance(value, Text) else None
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be True or False")


def shard_style(value) -> str:
    if value not in SHARD_STYLES:
        raise ValueError(f"must be one of {', '.join(SHARD_STYLES)}")
    return str(value)


def asked_precision(value) -> str | None:
    """precision= as the precision pass computes in: bf16 or fp16; fp32 (the model's own) asks for
    no pass, None."""
    return None if precision_name(value) == "fp32" else low_precision(value)


# optimize()'s argument -> (the record's field, its converter, what it is)
ARGUMENTS: dict[str, tuple[str, Callable[[Any], Any], str]] = {
    "budget_gb": ("budget_bytes", budget_in_bytes, "peak memory of one training step, in GB of 10**9 bytes"),
    "precision": ("precision", asked_precision, "the low precision: bf16 or fp16"),
    "precision_policy": ("precision_policy", parse_policy,
                         f"per-op mode overrides, op:mode;op:mode with modes {', '.join(MODES)}"),
    "stages": ("stages", count, "number of pipeline stages"),
    "profile": ("profile", to_bool, "cost nodes by their measured time instead of their estimate"),
    "calibrate": ("calibrate", to_bool, "measure one real step and plan again while it is over budget"),
    "optimizer": ("optimizer", check_optimizer, "the optimizer whose state and step() the budget covers: "
                                                "a torch.optim.Optimizer or " + ", ".join(NAMED)),
    "accumulate": ("accumulate", to_bool, "the step runs with every .grad present, backward adding into it"),
    "shard": ("shard", shard_style, "how the model is sharded"),
    "world_size": ("world_size", count, "ranks FSDP2 shards the step over"),
    "prefetch": ("prefetch", count, "batches graphopt.prefetch copies to the device ahead of the step"),
}
# an argument that refines what others ask for -> those others (one must be given with it)
REFINES = {"profile": ("budget_gb", "stages"), "calibrate": ("budget_gb",),
           "optimizer": ("budget_gb", "stages", "shard"), "accumulate": ("budget_gb", "shard"),
           "world_size": ("budget_gb", "shard"), "precision_policy": ("precision",), "prefetch": ("budget_gb",)}


@dataclass(frozen=True)
class OptimizeOptions:
    """optimize()'s options that ask for passes, each checked (api.checked_options) and held
    in the form the passes read: the budget in bytes, the precision as bf16 or fp16 (None: the
    model's own), the policy as sorted op:mode text, the optimizer a torch.optim.Optimizer or a name."""

    budget_bytes: int | None = None
    precision: str | None = None
    precision_policy: str | None = None
    stages: int | None = None
    profile: bool = False
    calibrate: bool = False
    optimizer: object = None
    accumulate: bool = False
    shard: str | None = None
    world_size: int | None = None
    prefetch: int | None = None
    # not an argument of optimize(): train_step's first pass over microbatch counts, which tries
    # every count with the optimizer on the device before any with its step on the host
    optimizer_on_device: bool = False

    def asked(self) -> tuple[str, ...]:
        """optimize()'s arguments that ask for something, by their names there."""
        names = {name: argument for argument, (name, _, _) in ARGUMENTS.items()}
        return tuple(names[f.name] for f in dataclasses.fields(self)
                     if f.name in names and getattr(self, f.name) is not None and getattr(self, f.name) is not False)
