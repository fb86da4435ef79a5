"""Pass-by-pass debugging dumps.

    dump_dir/
      00-trace.py  00-trace.txt      the traced graph (the base of the first diff)
      kk-name.py                     code of the GraphModule after pass kk, with source locations
      kk-name.txt                    node table: shape, dtype, bytes and every pass's annotations
      kk-name.diff                   unified diff of kk-name.py against the previous dump: the
                                     graph's code, then its recompute segments' code
      kk-name.*                      what the pass adds (recompute: memory.png)
      summary.md                     a row per pass (also for passes that changed nothing)
      kernels/                       generated kernel sources, when a pass generated any
      final.svg                      the final graph, when pydot and Graphviz are installed

Passes write their per-node decisions with `note(node, key, value)`; the node table shows them.
"""
from __future__ import annotations

import difflib
import os
import re
import shutil
from pathlib import Path

import torch
import torch.fx
from torch.fx.node import _get_qualified_name

from ..analysis.meta import TensorInfo, leaves, tensor_info
from ..analysis.segments import SegmentCall
from ..errors import UsageError
from ..passes.notes import notes
from ..passes.records import MemoryCurves
from .plot import memory_csv, memory_png
from .report import Report

def graph_code(gm: torch.fx.GraphModule) -> tuple[str, str]:
    """Readable code, with source locations: (of gm and its submodules, of its recompute segments)."""
    return gm.print_readable(print_output=False), segment_code(gm)


def code_diff(before: tuple[str, str], after: tuple[str, str], name: str) -> str:
    """Unified diff of the graph's code, then of its recompute segments' code, each against its
    own: one diff of the whole text would match a segment's body with the lines it took from
    the graph and show the rest of the graph as moved."""
    parts = []
    for (old, new), what in zip(zip(before, after), ("", " (recompute segments)")):
        parts += difflib.unified_diff(_without_frees(old), _without_frees(new),
                                      fromfile=f"before{what}", tofile=f"after {name}{what}")
    return "".join(parts)


# fx's code frees each value after its last use (`;  x = y = None`): a pass that moves one use
# changes that line without changing what it computes, so the diff leaves the frees out.
_FREES = re.compile(r";  (?:\w+ = )+None$")


def _without_frees(code: str) -> list[str]:
    return [_FREES.sub("", line) + "\n" for line in code.splitlines()]


def node_table(gm: torch.fx.GraphModule) -> str:
    head = ("name", "op", "target", "shape", "dtype", "bytes", "notes")
    rows = [head]
    for node in gm.graph.nodes:
        info = tensor_info(node)
        if isinstance(info, TensorInfo):
            shape, dtype, nbytes = str(list(info.shape)), str(info.dtype).replace("torch.", ""), str(info.nbytes)
        elif isinstance(info, tuple):
            parts = list(leaves(info))
            shape = " ".join(str(list(i.shape)) for i in parts)
            dtype = " ".join(sorted({str(i.dtype).replace("torch.", "") for i in parts}))
            nbytes = str(sum(i.nbytes for i in parts))
        else:
            shape = dtype = nbytes = ""
        marks = " ".join(f"{k}={v}" for k, v in notes(node).items())
        rows.append((node.name, node.op, _target(node), shape, dtype, nbytes, marks))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _target(node: torch.fx.Node) -> str:
    if isinstance(node.target, str):
        return node.target
    if isinstance(node.target, torch._ops.OpOverload):
        return str(node.target)
    try:
        return _get_qualified_name(node.target)
    except Exception:  # objects fx cannot name (lambdas, partials) still get a label
        return repr(node.target)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def check_dump_dir(directory) -> None:
    """Raise UsageError unless `directory` can hold dumps: a directory, or a path one can be made at."""
    if not isinstance(directory, (str, os.PathLike)):
        raise UsageError(f"dump_dir must be a path (str or os.PathLike), got {type(directory).__name__}.")
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise UsageError(f"dump_dir={str(directory)!r} is a file; give a directory (graphopt creates it).")
    existing = next((p for p in [path, *path.parents] if p.exists()), None)
    if existing is not None and not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        raise UsageError(f"dump_dir={str(directory)!r} cannot be written: {str(existing)!r} is not a writable "
                         "directory; give a directory you can write to.")


class Dumper:
    """Writes the dumps of one optimize() run into a directory it owns."""

    def __init__(self, directory: str | os.PathLike):
        check_dump_dir(directory)
        self.dir = Path(directory)
        if self.dir.exists():
            # Stale dumps from an earlier run would mix into this run's diffs.
            for old in self.dir.glob("[0-9][0-9]-*"):
                old.unlink()
            shutil.rmtree(self.dir / "kernels", ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.kernels = self.dir / "kernels"  # made with its first kernel: no empty folder in a dump
        self._previous = ("", "")

    def graph(self, index: int, name: str, gm: torch.fx.GraphModule) -> None:
        stem = self.dir / f"{index:02d}-{_slug(name)}"
        parts = graph_code(gm)
        stem.with_suffix(".py").write_text(parts[0] + (f"\n\n{parts[1]}" if parts[1] else ""))
        stem.with_suffix(".txt").write_text(node_table(gm))
        if index > 0:
            stem.with_suffix(".diff").write_text(code_diff(self._previous, parts, name))
        self._previous = parts

    def files(self, index: int, name: str, files: dict[str, str]) -> None:
        """Texts a pass made for the dumps, by name: "kernels/..." into the kernels directory,
        others next to the pass's own dump, as kk-name.<name>."""
        for rel, text in files.items():
            if rel.startswith("kernels/"):
                self.kernels.mkdir(exist_ok=True)
                (self.kernels / _slug(rel[len("kernels/"):])).write_text(text)
            else:
                (self.dir / f"{index:02d}-{_slug(name)}.{_slug(rel)}").write_text(text)

    def memory(self, index: int, name: str, memory: MemoryCurves) -> None:
        """The step's predicted memory through a pass, drawn next to the pass's own dump (the
        picture where matplotlib is installed)."""
        stem = f"{index:02d}-{_slug(name)}"
        (self.dir / f"{stem}.memory.csv").write_text(memory_csv(memory.curves))
        png = memory_png(memory.curves, memory.budget_bytes)
        if png is not None:
            (self.dir / f"{stem}.memory.png").write_bytes(png)

    def summary(self, report: Report) -> None:
        (self.dir / "summary.md").write_text(report.to_markdown())

    def svg(self, gm: torch.fx.GraphModule) -> bool:
        """Draw the final graph; False when pydot or Graphviz is missing."""
        if shutil.which("dot") is None:
            return False
        try:
            from torch.fx.passes.graph_drawer import FxGraphDrawer

            drawer = FxGraphDrawer(gm, "graphopt")
            (self.dir / "final.svg").write_bytes(drawer.get_dot_graph().create_svg())
            return True
        except ImportError:
            return False


def segment_code(gm: torch.fx.GraphModule) -> str:
    """Readable code of every recompute segment gm calls, for the dumps."""
    parts = []
    for n in gm.graph.nodes:
        if isinstance(n.target, SegmentCall):
            seg = n.target
            what = "its matmul outputs kept, the rest recomputed" if seg.selective else "recomputed"
            parts.append(f"# {seg.__name__}: {what} during backward\n"
                         + seg.module.print_readable(print_output=False))
    return "\n".join(parts)
