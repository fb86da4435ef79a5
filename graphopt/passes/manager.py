"""The pass manager: runs passes and owns everything around them.

The order of the passes is checked first (Pass.runs_after). For each pass: run it, then lint
and recompile the graph it returns (re-annotating it when it has nodes without metadata), time
it, optionally verify its numbers against the eager model (on the example and on a second batch
drawn apart from it: a graph right on its example only is caught here), and log a record of it
(records.PassLog) and hand its graph, files and memory curves to the dumps. Passes themselves
only rewrite and report stats.
"""
from __future__ import annotations

import time

import torch
import torch.fx

from ..analysis.meta import graph_device, is_annotated
from ..errors import GraphoptError, VerifyError
from ..frontend.trace import annotate
from ..verification.second_batch import second_batch
from ..verification.verify import TOLERANCE, Reference
from .base import Pass, PassContext
from .records import Dumps, PassLog, PassRecord
from .registry import check_order


def _count(gm: torch.fx.GraphModule) -> int:
    return len(gm.graph.nodes)


class PassManager:
    def __init__(self, passes: list[Pass], *, verify: bool = False, dumps: Dumps | None = None):
        check_order(passes)
        self.passes = list(passes)
        self.verify = verify
        self.dumps = dumps

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext, log: PassLog) -> torch.fx.GraphModule:
        """The graph after every pass; log gets a record of each, also when a pass or its
        verification raises."""
        references = self._references(ctx, log) if self.verify else []
        if references:  # what the frontend traced, before any pass is blamed for it
            self._verify(f"the trace (frontend {gm.meta.get('graphopt_frontend')!r})", "trace", gm, ctx, references)
        if self.dumps:
            self.dumps.graph(0, "trace", gm)
        ctx.staged = any(p.microbatches_of(None) for p in self.passes)
        ctx.writes_in_place = any(p.writes_in_place for p in self.passes)
        ctx.units = any(p.makes_units for p in self.passes)
        index = 0  # dumps are numbered by the passes that ran
        for p in self.passes:
            if p.by_default:
                why = p.skip_by_default(gm, ctx, self.passes)
                if why:
                    log.skipped[p.name] = why
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
                    f"pass {p.spec()!r} failed on {log.model}: {type(e).__name__}: {e}. This is a bug in "
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
            ctx.host_step = result.host_step or ctx.host_step
            elapsed = (time.perf_counter() - start) * 1e3
            record = PassRecord(
                name=p.spec(), time_ms=elapsed, nodes_before=before, nodes_after=_count(gm),
                changed=result.changed, stats=dict(result.stats), by_default=p.by_default,
                peak_bytes=result.peak_bytes, budget=result.budget,
            )
            log.passes.append(record)
            if references:
                errors = self._verify(f"pass {p.spec()!r}", p.name, gm, ctx, references)
                record.max_abs_err, record.max_rel_err = errors.max_abs, errors.max_rel
            if self.dumps and result.changed:
                self.dumps.graph(index, p.name, gm)
            if self.dumps and result.files:
                self.dumps.files(index, p.name, result.files)
            if self.dumps and result.memory is not None:
                self.dumps.memory(index, p.name, result.memory)
        return gm

    @staticmethod
    def _references(ctx: PassContext, log: PassLog) -> list[Reference]:
        """Eager's step on the example, and on a second batch where eager runs on one."""
        if ctx.reference is None:
            raise ValueError("verify=True needs the reference model in the pass context")
        references = [Reference(ctx.reference, ctx.example_args, ctx.example_kwargs, train=ctx.train,
                                label="the example")]
        args, kwargs = second_batch(ctx.example_args, ctx.example_kwargs)
        try:
            references.append(Reference(ctx.reference, args, kwargs, train=ctx.train,
                                        label="a second batch drawn apart from the example"))
        except Exception as e:  # values the model refuses (an index its example never reached): eager's call
            log.notes.append(f"verify: the model raised on a second batch drawn from the example's ranges "
                                f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); "
                                "verified on the example only")
        return references

    def _verify(self, what: str, pass_name: str, gm, ctx: PassContext, references: list[Reference]):
        """The worst errors of gm against eager over the batches; VerifyError naming `what` (a pass,
        or the trace) when they exceed its dtype's tolerance, or when gm raises where eager runs."""
        dtype = ctx.compute_dtype
        advice = ("try the other frontend (frontend='fx' or 'export') and report the model to graphopt"
                  if pass_name == "trace" else "leave it out of the pipeline and report the model to graphopt")
        worst = None
        for reference in references:
            try:
                errors = reference.errors(gm, dtype, graph_device(gm))
            except Exception as e:
                raise VerifyError(f"after {what} the graph raises on {reference.label}, where the model runs: "
                                  f"{type(e).__name__}: {e}. It is the first step to do so: {advice}.",
                                  pass_name=pass_name, errors={"worst": reference.label}) from e
            if worst is None or errors.max_rel > worst[0].max_rel:
                worst = errors, reference
        errors, reference = worst
        if not errors.within(dtype):
            raise VerifyError(
                f"{what} changed the numbers on {reference.label}: max relative error "
                f"{errors.max_rel:.3g} (max abs {errors.max_abs:.3g}, worst in {errors.worst}) exceeds the {dtype} "
                f"tolerance {TOLERANCE.get(dtype, TOLERANCE[torch.float32]):g}. It is the first step "
                f"to do so: {advice}.",
                pass_name=pass_name,
                errors={"max_abs": errors.max_abs, "max_rel": errors.max_rel, "worst": errors.worst},
            )
        return errors
