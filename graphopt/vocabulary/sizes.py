"""Bytes and budget_gb: GB means 10**9 bytes everywhere in graphopt (budget_gb=8 is 8e9 bytes), and
each way between the two is converted here, once."""
from __future__ import annotations

GB = 10**9


def budget_bytes(budget_gb: float) -> int:
    """A budget in bytes: budget_gb * 10**9 to the nearest byte (0.3 * 10**9 is 299999999.99999994
    in floating point; every pass and tool reads the same byte count for the same budget)."""
    return round(budget_gb * GB)


def in_gb(n: int) -> float:
    """Bytes as budget_gb reads them."""
    return n / GB
