"""graphopt: graph-rewriting passes that make PyTorch training fit and run faster.

    opt = graphopt.optimize(model, example_inputs, passes="normalize,cse,dce", dump_dir="dump")
    opt(x).loss.backward()

See README.md for the passes, the dumps and the architecture.
"""
from .analysis.meta import TensorInfo, tensor_info
from .api import DEFAULT_PASSES, optimize
from .errors import BudgetError, GraphoptError, ModeError, OptionError, TraceError, UsageError, VerifyError
from .passes import available as available_passes
from .report import PassRecord, Report
from .trace import trace
from .train_step import TrainStep, train_step

__version__ = "0.1.0"

__all__ = [
    "optimize", "train_step", "TrainStep", "trace", "available_passes", "DEFAULT_PASSES",
    "Report", "PassRecord", "TensorInfo", "tensor_info",
    "GraphoptError", "TraceError", "VerifyError", "BudgetError", "OptionError", "UsageError", "ModeError",
]
