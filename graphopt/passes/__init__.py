"""graphopt's passes: each one module, registered by name.

    parse_pipeline("normalize,cse,dce")  ->  [Pass, ...]
    available()                          ->  {name: Pass class}
"""
from .base import Option, Pass, PassContext, PassResult
from .registry import available, check_order, get, insert_in_order, parse_pipeline, register

# Importing a pass module registers it; only implemented passes are listed.
from . import normalize, cse, dce, recompute, fuse  # noqa: E402,F401
from . import inplace  # noqa: E402,F401
from . import precision  # noqa: E402,F401
from . import pipeline  # noqa: E402,F401
from .shard import shard_pass  # noqa: E402,F401

__all__ = ["Option", "Pass", "PassContext", "PassResult", "available", "get", "parse_pipeline", "register"]
