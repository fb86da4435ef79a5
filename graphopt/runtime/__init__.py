"""What rewritten graphs call at run time."""
from .fused import (FusedOp, cache_info, clear_cache, fused_call, launch_count, repro_script, running_fused, source)

__all__ = ["FusedOp", "cache_info", "clear_cache", "fused_call", "launch_count", "repro_script", "running_fused",
           "source"]
