"""graphopt: graph-rewriting passes that make PyTorch training fit and run faster.

    print(graphopt.measure_step(model, (x,), {"labels": y}))     # the step's peak and time
    print(graphopt.check_estimate(model, (x,), {"labels": y}))   # budget_gb's estimate against a real step
    opt = graphopt.optimize(model, (x,), example_kwargs={"labels": y}, budget_gb=8, dump_dir="dump")
    opt(x, labels=y).loss.backward()

See README.md to start, and docs/ for the passes, the dumps and the architecture.
"""
from .analysis.estimate_check import Divergence, EstimateCheck
from .analysis.meta import TensorInfo, tensor_info
from .api import DEFAULT_PASSES, optimize
from .errors import (BudgetError, BudgetWarning, GraphoptError, GraphoptWarning, MicrobatchWarning, ModeError,
                     OptionError, SizeError, TraceError, UsageError, VerifyError)
from .frontend.trace import trace
from .measure import measure_step
from .passes import available as available_passes
from .passes.records import PassRecord
from .plan import StepPlan, plan
from .reporting.report import Report
from .runtime.prefetch import Prefetch, prefetch
from .runtime.step import StepMeasure
from .training.train_step import TrainStep, train_step
from .verification.check_estimate import check_estimate

__version__ = "0.1.0"

__all__ = [
    "optimize", "train_step", "TrainStep", "plan", "StepPlan", "prefetch", "Prefetch", "measure_step", "StepMeasure", "check_estimate", "EstimateCheck",
    "Divergence", "trace", "available_passes", "DEFAULT_PASSES",
    "Report", "PassRecord", "TensorInfo", "tensor_info",
    "GraphoptError", "TraceError", "VerifyError", "BudgetError", "OptionError", "UsageError", "SizeError",
    "ModeError",
    "GraphoptWarning", "BudgetWarning", "MicrobatchWarning",
]
