"""What rewritten graphs call at run time."""
from .fused import FusedOp, cache_info, clear_cache, fused_call, repro_script, source

__all__ = ["FusedOp", "cache_info", "clear_cache", "fused_call", "repro_script", "source"]
