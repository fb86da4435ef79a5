"""Recompute: the pass (recompute_pass), the plan search (solver) and the graph rewrite (rewrite)."""
from .recompute_pass import Recompute

__all__ = ["Recompute"]
