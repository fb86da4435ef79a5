"""The longest sequence a model takes by its own code: a position table looked up by arange.

GPT-2, BERT and their kind add a learned embedding of each position, `wpe(arange(T))`. A table of
N rows takes T <= N; past it eager raises `IndexError: index out of range in self` from inside
the embedding. torch.export proves no bound for it (FakeTensors do not check indices), so an
exported graph would accept T = N + 1 and fail as eager does. This finds each such lookup in an
exported program: an embedding whose indices are an arange from 0 (through views and adds of a
constant, each op as the registry knows it) and whose table has a static number of rows, and gives the bound it puts on the
arange's length, by the length's symbol, or by its value where the length is static.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from .. import ops


@dataclass(frozen=True)
class PositionLimit:
    """arange(length) + offset looks up `table`, which has `rows` rows: length <= rows - offset."""

    table: str
    rows: int
    offset: int

    @property
    def longest(self) -> int:
        return self.rows - self.offset

    def __str__(self) -> str:
        return f"{self.table} has {self.rows} rows, looked up by position"


def position_limits(ep) -> list[tuple[object, int | None, PositionLimit]]:
    """(the arange length's sympy symbol, or None where it is static; its value in the example;
    the limit) for each position lookup of the exported program `ep`."""
    gm = ep.graph_module
    tables = {**ep.graph_signature.inputs_to_parameters, **ep.graph_signature.inputs_to_buffers}
    found = []
    for node in ep.graph.nodes:
        op = ops.lookup(node, gm) if node.op == "call_function" else None
        bound = ops.bind(node, gm) if op is not None and op.name == "embedding" else None
        if bound is None:
            continue
        weight, indices = bound.operands[:2]
        rows = _static_rows(weight)
        source = _arange_of(indices, gm)
        if rows is None or source is None or getattr(weight, "name", None) not in tables:
            continue
        arange, offset = source
        length = arange.meta.get("val")
        if not isinstance(length, torch.Tensor) or length.dim() != 1:
            continue
        size = length.shape[0]
        symbol = size.node.expr if isinstance(size, torch.SymInt) else None
        if symbol is not None and not symbol.is_Symbol:
            continue  # a length export relates to others by an expression: its symbols are bounded there
        example = size.node.hint if symbol is not None else int(size)
        found.append((symbol, example, PositionLimit(tables[weight.name], rows, offset)))
    return found


def _static_rows(weight) -> int | None:
    val = weight.meta.get("val") if isinstance(weight, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or not isinstance(val.shape[0], int):
        return None
    return int(val.shape[0])


def _arange_of(indices, gm: torch.fx.GraphModule) -> tuple[torch.fx.Node, int] | None:
    """(arange node counting from 0 by 1, constant added) where `indices` are its values, or some
    of them (a view picks or arranges them, none larger), else None. The registry says which op
    each node is."""
    offset, node = 0, indices
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        op = ops.lookup(node, gm)
        bound = ops.bind(node, gm) if op is not None else None
        if bound is None:
            return None
        if op.kind == "view":
            node = bound.operands[0]
        elif op.name == "add" and isinstance(bound.operands[1], int) and bound.params.get("alpha", 1) == 1:
            offset += bound.operands[1]
            node = bound.operands[0]
        elif op.name == "arange":
            p = bound.params
            return (node, offset) if p.get("start") == 0 and p.get("step") == 1 and offset >= 0 else None
        else:
            return None
    return None
