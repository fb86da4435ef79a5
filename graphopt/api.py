"""optimize(): trace -> pass pipeline -> a drop-in replacement for the model."""
from __future__ import annotations

import functools
import os
import time

import torch
import torch.fx

from . import passes as passes_pkg
from .analysis.batch_wide import batch_wide, traced_loss
from .analysis.planning_device import planning_device
from .errors import OptionError, UsageError
from .frontend.batch import batch_rows, splits_evenly
from .frontend.input_aliases import distinct
from .frontend.trace import FRONTENDS, check_inputs, trace
from .passes.base import Pass, PassContext
from .passes.manager import PassManager
from .passes.options import ARGUMENTS, REFINES, OptimizeOptions
from .passes.pipeline.pipeline_pass import Pipeline
from .passes.precision import Precision
from .passes.recompute.recompute_pass import Recompute
from .passes.records import PassLog
from .passes.shard.shard_pass import Shard
from .plan_cache.store import plan_store
from .reporting.dump import Dumper, check_dump_dir
from .reporting.report import Report
from .runtime.batch_graphs import install_batch_graphs
from .runtime.cuda_graphs import capture, check_cuda_graphs
from .runtime.guards import install_guards
from .runtime.host_optimizer import install_host_optimizer
from .runtime.input_writes import WriteAliasCheck
from .runtime.lazy import MAX_GRAPHS, LazyOptimized
from .runtime.microbatch import first_microbatch
from .runtime.microbatch_semantics import check_microbatching, check_batch_norm

# Passes run when the caller gives no pipeline: cleanups that every later pass benefits from,
# then those that pay without being asked; each says where it does not (Pass.skip_by_default:
# fuse off CUDA, inplace beside a budget), and the report says so. fuse before inplace: an op
# written in place joins no group, so groups take their ops whole and what stays eager is written
# in place.
DEFAULT_PASSES = ("normalize", "cse", "dce", "fuse", "inplace")


def build_pipeline(passes=None, options: OptimizeOptions = OptimizeOptions()) -> list[Pass]:
    """The pass list for optimize(): the given (or default) passes plus those its options ask for,
    each made from the record by the pass that reads it."""
    pipeline = passes_pkg.parse_pipeline(DEFAULT_PASSES if passes is None else passes)
    for p in pipeline:
        p.by_default = passes is None
    asked = []  # (the argument that asks for the pass, the pass)
    if options.stages is not None:  # one device per stage: budget_gb caps each
        asked.append(("stages", Pipeline.from_options(options)))
    elif options.budget_bytes is not None:
        asked.append(("budget_gb", Recompute.from_options(options)))
    if options.precision is not None:
        asked.append(("precision", Precision.from_options(options)))
    if options.shard is not None:
        asked.append(("shard", Shard.from_options(options)))
    names = {p.name for p in pipeline}
    for argument, p in asked:
        if p.name in names:
            raise OptionError(f"give {argument} either as optimize({argument}=...) or in the {p.name!r} pass of the "
                              "pipeline, not both.")
        passes_pkg.insert_in_order(pipeline, p)
    passes_pkg.check_order(pipeline)
    return pipeline


def checked_options(arguments: dict) -> OptimizeOptions:
    """The record of optimize()'s arguments that ask for passes, given by name, or OptionError
    naming the argument at fault: a bad value, or a combination no pass takes."""
    fields = {}
    for argument, value in arguments.items():
        name, convert, what = ARGUMENTS[argument]
        if value is None or value is False:  # not given: the record's default
            continue
        try:
            fields[name] = convert(value)
        except (TypeError, ValueError) as e:
            raise OptionError(f"optimize({argument}=...): bad value {value!r} ({what}): {e}.") from None
    options = OptimizeOptions(**fields)
    _check_together(options)
    return options


def _check_together(options: OptimizeOptions) -> None:
    """OptionError for arguments no pass takes together, or one given without what it refines."""
    asked = set(options.asked())
    if options.stages is not None:
        if options.shard is not None:
            raise OptionError("shard= and stages= split the model two ways: FSDP units run on every rank, "
                              "pipeline stages one per rank. Give one of them.")
        if options.calibrate:
            raise OptionError("calibrate= measures a one-device step of the recompute plan; with stages=, "
                              "budget_gb caps each stage's predicted memory: leave calibrate out.")
        if options.accumulate:
            raise OptionError("with stages=, the pipeline accumulates its microbatches' gradients itself and "
                              "budget_gb caps each stage: leave accumulate out.")
        if options.optimizer is not None and not isinstance(options.optimizer, str):
            raise OptionError("with stages=, optimizer= names the optimizer whose state each stage holds "
                              "(e.g. optimizer='adam'), not an instance.")
    elif options.budget_bytes is not None and options.world_size:
        if options.shard is None:
            raise OptionError("world_size= is the ranks FSDP2 shards the step over: give shard='fsdp' too.")
        if options.calibrate:
            raise OptionError("with world_size=, the plan is held to a rank's estimated step; calibrate= measures "
                              "one device's: leave it out.")
    for argument, leads in REFINES.items():
        if argument in asked and not asked & set(leads):
            if len(leads) == 1:
                raise OptionError(f"{argument}= refines what {leads[0]}= asks for: give {leads[0]} too.")
            raise OptionError(f"{argument}= refines what {' or '.join(f'{lead}=' for lead in leads)} asks for: give "
                              "one of them too.")


def optimize(
    model: torch.nn.Module,
    example_inputs=None,
    example_kwargs: dict | None = None,
    *,
    budget_gb: float | None = None,
    passes=None,
    precision: str | None = None,
    stages: int | None = None,
    train: bool | None = None,
    profile: bool = False,
    calibrate: bool = False,
    precision_policy: dict | str | None = None,
    optimizer=None,
    accumulate: bool = False,
    frontend: str = "auto",
    dump_dir: str | os.PathLike | None = None,
    verify: bool = False,
    batch_norm: str = "warn",
    shard: str | None = None,
    world_size: int | None = None,
    cuda_graphs: bool = False,
    plan_cache: bool | str | os.PathLike = True,
    prefetch: int | None = None,
):
    """Rewrite `model` through a pass pipeline and return a drop-in replacement.

    With example inputs: a torch.fx.GraphModule, traced and optimized now. Without: an
    nn.Module that does so on its first call, and again for a call that no graph it built takes
    (another train/eval mode or kind of input; sizes its graphs' guards or budget plan refuse).
    Either shares the model's Parameters and buffers and takes the same
    arguments; `.graphopt_report` holds the per-pass summary.

    example_inputs: forward()'s positional arguments (a tensor or a tuple); example_kwargs: its
      keyword arguments, a dict, given by name or positionally, as measure_step, plan and
      train_step take them: `optimize(model, (x,), {"labels": y}, budget_gb=8)`.

    budget_gb: peak memory of one training step, in GB of 10**9 bytes (recompute pass); with
      stages, the memory cap of each stage (pipeline pass).
    profile: with budget_gb, cost recomputation by each node's measured time, not its FLOPs;
      with stages, cost the stages so.
    calibrate: with budget_gb, run one real step and plan again while it measures over budget.
    optimizer: with budget_gb, the optimizer the step ends with: a torch.optim.Optimizer or
      "sgd", "momentum", "adam", "adamw". Its state and its step() are then in the budget,
      measured by running its class on stand-in tensors; without it the budget covers forward
      and backward. With stages, a name: the state each stage holds (default "adam").
    accumulate: with budget_gb, the step runs with every .grad already present and backward adds
      into it, as in gradient accumulation after the first microbatch (graphopt.train_step does
      this for you): the budget covers the gradients from the start. Default: .grad None before
      each step (optimizer.zero_grad()'s default).
    precision_policy: with precision, per-op modes overriding autocast's, e.g.
      {"softmax": "low", "linear": "fp32"} (modes: low, fp32, promote, follow).
    precision: "bf16" or "fp16" (precision pass). stages: pipeline stages (pipeline pass); the
      model is then traced and planned on one microbatch, the first 1/M of the example batch
      (M = pipeline{microbatches=M}, default 2 x stages, at most the batch); called with the
      example batch, the result runs its M microbatches one after another, outputs merged.
    train: build for a training step (True) or inference (False); default model.training.
      The model is put in that mode, and the result refuses to run in the other.
    dump_dir: write pass-by-pass dumps there (default: $GRAPHOPT_DUMP, else none).
    verify: after each pass, compare outputs and gradients with the eager model and raise
      VerifyError naming the first pass that changed them beyond the dtype's tolerance.
    shard: "fsdp" (shard pass): each repeated block becomes a submodule unit_k that torch's
      fully_shard can shard on its own (graphopt.runtime.fsdp.fully_shard_units applies it).
    world_size: with shard, the ranks FSDP2 shards over: budget_gb is then one rank's peak
      (its shard of parameters, gradients and optimizer state, the gathered units, activations),
      and the report gives a rank's predicted peak.
    batch_norm: with stages in training, where a BatchNorm would normalize each microbatch by its
      own statistics: "warn" (default: a MicrobatchWarning, as for random ops and the loss's
      reduction) or "refuse" (a UsageError naming the modules).
    cuda_graphs: capture the optimized training step's forward and backward as CUDA graphs at the
      example's signature, replayed by every call of that signature (others run uncaptured):
      what a step costs the host becomes a few copies and two replays. Needs the model and the
      example inputs on CUDA, a training step, example inputs, and a step that never waits on the
      device (no .item()); with budget_gb the plan leaves room for what the graphs hold. Outputs
      live in the graphs' buffers, overwritten by the next call (runtime/cuda_graphs.py).
    prefetch: with budget_gb, the depth of the graphopt.prefetch the batches come through: the
      batches it holds on the device ahead of the step (that many of the example's size) are
      kept out of the budget the step is planned for.
    plan_cache: keep a budget's plan on disk and take it from there when the same graph is
      planned again with the same settings, in a later process (plan_cache/): True (default) in
      $GRAPHOPT_CACHE_DIR or ~/.cache/graphopt, a directory, or False. $GRAPHOPT_PLAN_CACHE=off
      turns the default off; with dump_dir it is not used (the dumps show the search).
      `python -m graphopt cache clear` empties it.
    """
    if not isinstance(model, torch.nn.Module):
        check_inputs(model, example_inputs, example_kwargs)  # raises the UsageError
    options = checked_options(dict(budget_gb=budget_gb, precision=precision, precision_policy=precision_policy,
                                   stages=stages, profile=profile, calibrate=calibrate, optimizer=optimizer,
                                   accumulate=accumulate, shard=shard, world_size=world_size, prefetch=prefetch))
    return optimize_with(model, example_inputs, example_kwargs, options, passes=passes, train=train,
                         frontend=frontend, dump_dir=dump_dir, verify=verify, batch_norm=batch_norm,
                         cuda_graphs=cuda_graphs, plan_cache=plan_cache)


def optimize_with(model: torch.nn.Module, example_inputs, example_kwargs, options: OptimizeOptions, *, passes=None,
                  train: bool | None = None, frontend: str = "auto", dump_dir=None, verify: bool = False,
                  batch_norm: str = "warn", cuda_graphs: bool = False, plan_cache=True):
    """optimize() with its options that ask for passes already checked (the record train_step
    plans each microbatch count with); the others as optimize() takes them."""
    if frontend not in FRONTENDS:
        raise OptionError(f"unknown frontend {frontend!r}; choose one of {', '.join(FRONTENDS)}.")
    if train is not None and not isinstance(train, bool):
        raise OptionError(f"train must be True, False or None, got {train!r}.")
    pipeline = build_pipeline(passes, options)
    check_cuda_graphs(cuda_graphs, example_inputs is None and example_kwargs is None, options.stages, options.shard,
                      model.training if train is None else train)
    if not isinstance(verify, bool):
        raise OptionError(f"verify must be True or False, got {verify!r}.")
    dump_dir = dump_dir if dump_dir is not None else os.environ.get("GRAPHOPT_DUMP") or None
    if dump_dir is not None:
        check_dump_dir(dump_dir)
    settings = dict(pipeline=pipeline, frontend=frontend, verify=verify, batch_norm=check_batch_norm(batch_norm),
                    cuda_graphs=cuda_graphs, plan_cache=plan_store(plan_cache, dump_dir))
    if train is not None:
        model.train(train)
    if example_inputs is None and example_kwargs is None:
        return LazyOptimized(model, functools.partial(optimize_now, **settings), dump_dir)
    return optimize_now(model, example_inputs, example_kwargs, **settings, dump_dir=dump_dir, other_batches=True)


def optimize_now(model, example_inputs, example_kwargs, *, pipeline, frontend, verify, dump_dir, batch_norm="warn",
                 cuda_graphs=False, plan_cache=None, other_batches=False):
    """Trace `model` in its current mode and run `pipeline` over it. other_batches: a call at a batch
    size the graph does not take builds a graph for it (runtime/batch_graphs.py)."""
    as_called = check_inputs(model, example_inputs, example_kwargs)  # inputs sharing storage still share it
    args, kwargs = distinct(*as_called)  # what the passes plan for is what the frontend traced
    rows = batch_rows(args, kwargs)
    microbatches = next((m for m in (p.microbatches_of(rows) for p in pipeline) if m), None)
    batch = args, kwargs
    if microbatches:  # pipeline stages run on microbatches: trace and plan for one
        args, kwargs = first_microbatch(args, kwargs, microbatches)
    start = time.perf_counter()
    gm = trace(model, args, kwargs, frontend=frontend)
    writes = WriteAliasCheck(model, gm, gm.meta["graphopt_written_inputs"])
    writes.check(gm, *as_called, "the example")
    if microbatches and gm.meta["graphopt_frontend"] == "export" and gm.meta["graphopt_batch"] is None \
            and not splits_evenly(*batch, microbatches):
        raise UsageError(
            f"the example batch does not split into {microbatches} equal microbatches, and a graph traced "
            "with frontend='export' runs on one microbatch size only: give a batch that "
            f"microbatches={microbatches} divides (pipeline{{microbatches=...}}), or use frontend='fx'.")
    report = Report(
        model=type(model).__name__, frontend=gm.meta["graphopt_frontend"],
        trace_ms=(time.perf_counter() - start) * 1e3, nodes=len(gm.graph.nodes),
        dump_dir=str(dump_dir) if dump_dir else None, batch_wide=batch_wide(gm),
    )
    report.notes += check_microbatching(report.batch_wide, microbatches or 1, batch_norm,
                                        f"the staged graph ({microbatches} microbatches)")
    ctx = PassContext(example_args=args, example_kwargs=kwargs, train=model.training, reference=model,
                      microbatches=microbatches, cuda_graphs=cuda_graphs, plan_cache=plan_cache)
    dumper = Dumper(dump_dir) if dump_dir else None
    log = PassLog(model=report.model)
    try:
        gm = PassManager(pipeline, verify=verify, dumps=dumper).run(gm, ctx, log)
    finally:  # the dumps' summary also of a run a pass or its verification stopped
        report.passes, report.skipped, report.notes = log.passes, log.skipped, report.notes + log.notes
        if dumper:
            dumper.summary(report)
    gm.train(model.training)  # modules a pass made (the pipeline's stages) start in training mode
    if ctx.host_step is not None:
        report.host_step = ctx.host_step
        if planning_device() is None:  # graphopt.plan plans the step; a real one steps the optimizer on the host
            install_host_optimizer(next(p.settings.optimizer for p in pipeline if isinstance(p, Recompute)),
                                   gradients=ctx.host_step.gradients)
    if dumper:
        dumper.svg(gm)
    report.runs_at = install_guards(gm, model, as_called, (args, kwargs), batch, microbatches, ctx.specialized,
                                    ctx.call_checks, writes, traced_loss(report.batch_wide))
    if cuda_graphs:
        report.cuda_graphs = capture(gm, *as_called, ctx)
    if other_batches and rows is not None and not microbatches:
        settings = dict(pipeline=pipeline, frontend=frontend, verify=verify, batch_norm=batch_norm,
                        cuda_graphs=cuda_graphs, plan_cache=plan_cache)

        def build(args, kwargs, training, dump_dir):
            model.train(training)
            return optimize_now(model, args, kwargs or None, **settings, dump_dir=dump_dir)

        install_batch_graphs(gm, build, (args, kwargs), dump_dir and str(dump_dir), MAX_GRAPHS)
        if ctx.specialized or gm.meta["graphopt_frontend"] == "export":
            report.runs_at += "; at a batch size it does not take, a graph built for it at its first call"
    gm.graphopt_report = report
    return gm


