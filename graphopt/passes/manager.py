"""The pass manager: runs passes and owns everything around them.

The order of the passes is checked first (Pass.runs_after). For each pass: run it, then lint
and recompile the graph it returns (re-annotating it when it has nodes without metadata), time
it, optionally verify its numbers against the eager model, and record a report row and the
dumps. Passes themselves only rewrite and report stats.
"""
from __future__ import annotations

import time

import torch
import torch.fx

from ..analysis.meta import graph_device, is_annotated
from ..dump import Dumper
from ..errors import GraphoptError, VerifyError
from ..report import PassRecord, Report
from ..trace import annotate
from ..verify import TOLERANCE, autocast_step, compare, float64_step, run_step
from .base import Pass, PassContext
from .registry import check_order


def _count(gm: torch.fx.GraphModule) -> int:
    return len(gm.graph.nodes)


class PassManager:
    def __init__(self, passes: list[Pass], *, verify: bool = False, dumper: Dumper | None = None):
        check_order(passes)
        self.passes = list(passes)
        self.verify = verify
        self.dumper = dumper

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext, report: Report) -> torch.fx.GraphModule:
        reference = truth = autocast = None
        if self.verify:
            if ctx.reference is None:
                raise ValueError("verify=True needs the reference model in the pass context")
            reference = run_step(ctx.reference, ctx.example_args, ctx.example_kwargs, train=ctx.train, seed=0)
        if self.dumper:
            self.dumper.graph(0, "trace", gm)
        names = {p.name for p in self.passes}
        ctx.pipeline = frozenset(names)
        index = 0  # dumps are numbered by the passes that ran
        for p in self.passes:
            if p.by_default:
                why = p.skip_by_default(gm, ctx, names)
                if why:
                    report.skipped[p.name] = why
                    continue
            index += 1
            before = _count(gm)
            start = time.perf_counter()
            try:
                result = p.run(gm, ctx)
            except GraphoptError:
                raise
            except Exception as e:
                # Bad input is refused before any pass runs: what reaches here is a bug in graphopt.
                raise GraphoptError(
                    f"pass {p.spec()!r} failed on {report.model}: {type(e).__name__}: {e}. This is a bug in "
                    "graphopt: please report it with the model (dump_dir= writes the graph the pass was given); "
                    "meanwhile run without this pass."
                ) from e
            gm = result.graph_module
            if result.changed:
                ctx.analyses.drop()
                gm.graph.lint()
                gm.recompile()
                # New nodes come without metadata (and a pass that changes what a node computes
                # invalidates it): only then does the graph need another FakeTensor run.
                if not all(is_annotated(n) for n in gm.graph.nodes):
                    annotate(gm, ctx.flat_inputs(gm))
            ctx.compute_dtype = result.compute_dtype or ctx.compute_dtype
            ctx.specialized = result.specialized or ctx.specialized
            ctx.call_checks.extend(result.call_checks)
            elapsed = (time.perf_counter() - start) * 1e3
            record = PassRecord(
                name=p.spec(), time_ms=elapsed, nodes_before=before, nodes_after=_count(gm),
                changed=result.changed, stats=dict(result.stats), by_default=p.by_default,
                peak_bytes=result.stats.get("predicted_peak_bytes"),
            )
            report.passes.append(record)
            if reference is not None:
                got = run_step(gm, ctx.example_args, ctx.example_kwargs, train=ctx.train, seed=0)
                errors = compare(reference, got)
                dtype = ctx.compute_dtype
                if not errors.within(dtype) and dtype == torch.float32:
                    # beyond float32's tolerance: no further from float64 than eager is passes too
                    if truth is None:
                        truth = float64_step(ctx.reference, ctx.example_args, ctx.example_kwargs, train=ctx.train,
                                             seed=0)
                    errors = compare(reference, got, truth, TOLERANCE[dtype])
                elif not errors.within(dtype):
                    # half precision: within tolerance of torch.autocast, or no further from float32
                    # than autocast is, passes too
                    if autocast is None:
                        autocast = autocast_step(ctx.reference, ctx.example_args, ctx.example_kwargs,
                                                 train=ctx.train, seed=0, device=graph_device(gm), dtype=dtype)
                    errors = compare(autocast, got, reference, TOLERANCE[dtype])
                record.max_abs_err, record.max_rel_err = errors.max_abs, errors.max_rel
                if not errors.within(dtype):
                    if self.dumper:
                        self.dumper.summary(report)
                    raise VerifyError(
                        f"pass {p.spec()!r} changed the numbers: max relative error {errors.max_rel:.3g} "
                        f"(max abs {errors.max_abs:.3g}, worst in {errors.worst}) exceeds the {dtype} "
                        f"tolerance {TOLERANCE.get(dtype, TOLERANCE[torch.float32]):g}. It is the first pass "
                        "to do so: leave it out of the pipeline and report the model to graphopt.",
                        pass_name=p.name,
                        errors={"max_abs": errors.max_abs, "max_rel": errors.max_rel, "worst": errors.worst},
                    )
            if self.dumper and result.changed:
                self.dumper.graph(index, p.name, gm)
            if self.dumper and result.artifacts:
                self.dumper.artifacts(index, p.name, result.artifacts)
        if self.dumper:
            self.dumper.summary(report)
        return gm
