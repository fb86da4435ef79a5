"""The registry of available passes and the text form of a pipeline.

A pipeline is a list of passes or text in the spirit of MLIR's pass-pipeline syntax:
    "normalize,cse,recompute{budget_gb=4},pipeline{stages=2 schedule=1f1b}"
Options go in braces, separated by spaces or commas.
"""
from __future__ import annotations

from typing import Iterable

from ..errors import OptionError
from .base import Pass, Text

_PASSES: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    if cls.name in _PASSES:
        raise ValueError(f"a pass named {cls.name!r} is already registered")
    _PASSES[cls.name] = cls
    return cls


def available() -> dict[str, type[Pass]]:
    """Every pass this version of graphopt implements, by name."""
    return dict(_PASSES)


def get(name: str) -> type[Pass]:
    try:
        return _PASSES[name]
    except KeyError:
        raise OptionError(f"unknown pass {name!r}; available passes: {', '.join(sorted(_PASSES))}.") from None


def check_order(passes: list[Pass]) -> None:
    """Raise OptionError when a pass comes before one it must run after (Pass.runs_after)."""
    position = {p.name: i for i, p in enumerate(passes)}
    for i, p in enumerate(passes):
        for earlier, why in p.runs_after.items():
            if position.get(earlier, -1) > i:
                raise OptionError(
                    f"pass {p.name!r} comes before {earlier!r} in the pipeline, but must run after it: {why}. "
                    f"Put {earlier!r} first.")


def insert_in_order(passes: list[Pass], new: Pass) -> None:
    """Add `new` before the first pass that must run after it, else at the end."""
    at = next((i for i, p in enumerate(passes) if new.name in p.runs_after), len(passes))
    passes.insert(at, new)


def _split_top(text: str) -> list[str]:
    """Split on commas outside braces."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise OptionError(f"pipeline {text!r} has an unmatched '}}'.")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise OptionError(f"pipeline {text!r} has an unclosed '{{'.")
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def parse_one(text: str) -> Pass:
    text = text.strip()
    name, _, rest = text.partition("{")
    options: dict[str, str] = {}
    if rest:
        if not rest.endswith("}"):
            raise OptionError(f"pass spec {text!r} must end with '}}'.")
        for item in rest[:-1].replace(",", " ").split():
            key, eq, value = item.partition("=")
            if not eq:
                raise OptionError(f"pass spec {text!r}: option {item!r} must be written key=value.")
            options[key.strip()] = Text(value.strip())
    return get(name.strip())(**options)


def parse_pipeline(spec: str | Iterable) -> list[Pass]:
    """Passes from text, or from a list of Pass instances, names, specs or (name, options) pairs."""
    if isinstance(spec, str):
        return [parse_one(p) for p in _split_top(spec)]
    if isinstance(spec, Pass):
        return [spec]
    if not isinstance(spec, Iterable) or isinstance(spec, (bytes, dict)):
        raise OptionError(
            f"passes must be text like 'normalize,cse' or a list of passes, got {type(spec).__name__} {spec!r}; "
            "e.g. passes='normalize,fuse' or passes=['normalize', ('recompute', {'budget_gb': 8})]."
        )
    passes = []
    for item in spec:
        if isinstance(item, Pass):
            passes.append(item)
        elif isinstance(item, str):
            passes.append(parse_one(item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], dict):
            passes.append(get(item[0])(**item[1]))
        else:
            raise OptionError(
                f"pipeline item {item!r} is not a pass; give a Pass, a name like 'cse', "
                "a spec like 'recompute{budget_gb=4}', or a (name, options) pair."
            )
    return passes
