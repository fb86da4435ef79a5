"""Shard: the graph's repeated blocks as FSDP units (shard_pass), the rewrite (units)."""
from .shard_pass import Shard

__all__ = ["Shard"]
