"""optimize()'s arguments that ask for passes, typed: each pass reads the ones it takes.

    optimize(model, x, budget_gb=8)  ->  OptimizeArguments(budget_gb=8)  ->  Recompute.from_arguments(args)
                                         (args.budget_gb: the recompute pass's budget_gb option)

A pass declares the fields it takes (Pass.arguments, the first of which adds it to the pipeline)
and builds itself from them in from_arguments, where each option is validated once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..vocabulary.precisions import precision_name


@dataclass(frozen=True)
class OptimizeArguments:
    budget_gb: float | None = None
    precision: str | None = None
    stages: int | None = None
    profile: bool = False
    calibrate: bool = False
    precision_policy: dict | str | None = None
    optimizer: object = None
    accumulate: bool = False
    shard: str | None = None
    world_size: int | None = None

    def given(self) -> tuple[str, ...]:
        """The arguments that ask for something: None, False, {} and float32 precision ask for nothing."""
        asked = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "precision" and precision_name(value) == "fp32":
                continue
            if value is not None and value is not False and value != {}:
                asked.append(f.name)
        return tuple(asked)


NAMES = tuple(f.name for f in dataclasses.fields(OptimizeArguments))
