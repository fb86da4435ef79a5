"""The command line's words for what the library says in Python's: optimize()'s keyword
arguments in its errors, warnings and report written as the flags that set them."""
from __future__ import annotations

import contextlib
import re
import sys
import warnings

from ..errors import GraphoptWarning

# optimize()'s keyword arguments as this command line's flags spell them: the library's errors and
# notes speak Python, and what a user of the command line can type is a flag
FLAGS = {"budget_gb": "--budget-gb", "stages": "--stages", "precision": "--precision", "profile": "--profile",
         "calibrate": "--calibrate", "frontend": "--frontend", "verify": "--verify", "passes": "--passes",
         "dump_dir": "--dump", "loss_fn": "--loss", "train": "--mode", "optimizer": "--optimizer"}
_NAME = "|".join(FLAGS)
_SPELLINGS = [
    # "loss_fn=... (on the command line, --loss pkg.module:function)": the flag the text already gives
    (re.compile(rf"\b(?:{_NAME})=\.\.\. \(on the command line, ([^)]*)\)"), lambda m: m[1]),
    (re.compile(rf"\boptimize\(({_NAME})=\.\.\.\)"), lambda m: FLAGS[m[1]]),
    (re.compile(r"\btrain=(True|False)\b"), lambda m: "--mode " + ("train" if m[1] == "True" else "eval")),
    (re.compile(r"\b(profile|calibrate|verify)=True\b"), lambda m: FLAGS[m[1]]),
    (re.compile(rf"\b({_NAME})=('?)([\w.+-]+)\2"), lambda m: f"{FLAGS[m[1]]} {m[3]}"),
    (re.compile(rf"\b({_NAME})="), lambda m: FLAGS[m[1]]),
    (re.compile(rf"\b(leave|give) ({_NAME})\b"), lambda m: f"{m[1]} {FLAGS[m[2]]}"),
    (re.compile(r"(?<!['\w])(budget_gb|loss_fn|dump_dir)(?!['\w])"), lambda m: FLAGS[m[1]]),
    # train_step is Python's; the command line's plan says how many microbatches fit
    (re.compile(r"\bwith graphopt\.train_step \("), lambda m: "with graphopt.train_step in Python (`python -m graphopt "
                                                               "plan MODEL --budget-gb B` says how many: "),
]


def cli_text(text: str) -> str:
    """A graphopt message with optimize()'s keyword arguments written as this command's flags
    (budget_gb=0.5 -> --budget-gb 0.5, precision='bf16' -> --precision bf16); pass specs in braces,
    which --passes takes as they are, unchanged."""
    parts = re.split(r"(\{[^{}]*\})", text)
    for k in range(0, len(parts), 2):
        for pattern, flag in _SPELLINGS:
            parts[k] = pattern.sub(flag, parts[k])
    return "".join(parts)


@contextlib.contextmanager
def graphopt_warnings():
    """While open, graphopt's warnings are held and then written as `graphopt: warning: ...`
    lines in the flags' terms, also when what ran raised; other warnings as Python shows them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphoptWarning)
        try:
            yield
        finally:
            for w in caught:
                if issubclass(w.category, GraphoptWarning):
                    print(f"graphopt: warning: {cli_text(str(w.message))}", file=sys.stderr)
                else:
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)
