"""Shard: the graph's repeated blocks as FSDP units (shard_pass, registered by graphopt.passes), the
rewrite (units) and a rank's step under FSDP2 (rank_memory), which the recompute pass asks too."""
