"""Pipeline: the pass (pipeline_pass), stage balancing (partition) and the graph split (split)."""
from .pipeline_pass import Pipeline

__all__ = ["Pipeline"]
