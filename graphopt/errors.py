"""The errors and warnings graphopt raises: each one sentence that says what was wrong and what to do."""
import os
import sys
import warnings

from .vocabulary.sizes import in_gb


class GraphoptError(Exception):
    """Base class of every error graphopt raises on purpose."""


class TraceError(GraphoptError):
    """No frontend could capture the model as a graph."""

    def __init__(self, message: str, reasons: dict[str, str] | None = None):
        self.reasons = dict(reasons or {})
        if self.reasons:
            details = "\n".join(f"  - {name}: {why}" for name, why in self.reasons.items())
            message = f"{message}\n{details}"
        super().__init__(message)


class VerifyError(GraphoptError):
    """A pass changed the numbers beyond the tolerance for their dtype."""

    def __init__(self, message: str, pass_name: str, errors: dict | None = None):
        self.pass_name = pass_name
        self.errors = dict(errors or {})
        super().__init__(message)


class BudgetError(GraphoptError):
    """No plan fits the memory budget; carries the budget refused and the smallest that would fit,
    in bytes, and the latter as budget_gb reads it (min_budget_gb)."""

    def __init__(self, message: str, min_budget_bytes: int | None = None, breakdown: dict | None = None,
                 headroom: float = 0.0, budget_bytes: int | None = None):
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.breakdown = dict(breakdown or {})
        self.headroom = headroom  # the fraction of a budget kept free, above the step's peak (CUDA's)
        super().__init__(message)

    @property
    def min_budget_gb(self) -> float | None:
        return None if self.min_budget_bytes is None else in_gb(self.min_budget_bytes)


class OptionError(GraphoptError, ValueError):
    """An unknown pass, an unknown option, or an option value out of range."""


class UsageError(GraphoptError, TypeError):
    """An argument of the wrong kind: not a module, inputs that are not tensors, ..."""


class SizeError(UsageError, IndexError):
    """An input size past what the model's own code takes (a position table's rows): eager raises
    IndexError there, and so does this, with the limit and its reason."""


def traced_kinds_refused(what: str) -> UsageError:
    """The UsageError of a call whose tensors differ in dtype or device from those the graph was
    traced with (under torch.autocast, or after model.half()); `what` says where it showed."""
    return UsageError(f"{what}: an optimized module runs in the dtypes and on the device it was traced in. "
                      "Call it outside torch.autocast (graphopt.optimize(..., precision='bf16') gives autocast's "
                      "mixed precision), and optimize the model again after changing its dtype or device "
                      "(model.half(), model.to(...)).")


class ModeError(GraphoptError, RuntimeError):
    """The optimized graph was built for training (or inference) and is used in the other mode."""


class GraphoptWarning(UserWarning):
    """Base class of graphopt's warnings: what was asked for ran, but likely not as meant."""


class BudgetWarning(GraphoptWarning):
    """A memory budget at or above what the step needs as it is: it asks for nothing."""


class MicrobatchWarning(GraphoptWarning):
    """A batch runs in microbatches, and something in the model depends on the batch as a whole."""


def warn(message: str, category: type[Warning] = GraphoptWarning) -> None:
    """warnings.warn, shown at the first caller outside graphopt: the line of the user's that led to it."""
    package = os.path.dirname(os.path.abspath(__file__))
    level, frame = 2, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
