"""Command line: `python -m graphopt demo`, `python -m graphopt optimize pkg.module:factory`,
`python -m graphopt plan pkg.module:factory`, `python -m graphopt check-estimate pkg.module:factory`
and `python -m graphopt cache {show,clear}`."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

from .analysis.memory import size_text
from .analysis.trial import trial_run
from .api import DEFAULT_PASSES, optimize
from .demo.before_after import measure
from .demo.run import dumps_line, record_markdown, run_demo
from .errors import GraphoptError, UsageError
from .passes import available
from .plan import plan
from .plan_cache.store import PlanStore
from .reporting.cli_text import cli_text, graphopt_warnings
from .runtime.step import output_loss
from .verification.check_estimate import check_estimate
from .vocabulary.precisions import PRECISIONS
from .vocabulary.sizes import budget_bytes


def _demo(args) -> int:
    if args.record:
        _check_writable(args.record)
    result, status = run_demo(args.dump, device=args.device)
    table = result.to_text()
    optimized = result.optimized
    if optimized is not None:
        table += (f"\n\nbudget {size_text(result.budget_bytes)}: measured {size_text(optimized.peak_bytes)} "
                  f"({optimized.peak_bytes / result.budget_bytes:.2f} of it) against eager's "
                  f"{size_text(result.eager.peak_bytes)}, step time x{optimized.step_ms / result.eager.step_ms:.2f}")
    print()
    print(table)
    for line in result.over_budget():
        print(f"graphopt: error: {line.label} measured {size_text(line.peak_bytes)}, over the budget", file=sys.stderr)
    print(dumps_line(result, args.dump))
    written = _written(args.dump)
    if args.record:
        with open(args.record, "w") as f:
            # a thread count set from outside changes the times, so the command written down shows it
            threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
            f.write(record_markdown(result, table, args.dump,
                                    command=f"{threads}python -m graphopt demo --record {args.record}"))
        written.append(args.record)
    print(f"total {result.seconds:.0f} s; written: {', '.join(written)}")
    return status


def _check_writable(path: str) -> None:
    """UsageError before the demo's minutes of work when --record could not be written."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot make the folder of --record {path}: {e.strerror}; give a path you can write.") from None
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise UsageError(f"cannot write --record {path}: give the path of a markdown file in a folder you can write.")


def _written(directory) -> list[str]:
    return [os.path.join(directory, name) for name in ("summary.json", "summary.md", "memory.png")]


def _load(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise UsageError(f"model {spec!r} must be written pkg.module:factory (a function or class that builds the model).")
    sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"cannot load {spec!r}: {e}. Check the module is importable from here and names {attr!r}.") from None
    return factory()


def _built(args, example: str) -> tuple:
    """(model, inputs, kwargs) from the factory and --inputs; `example` shows what --inputs takes."""
    built = _load(args.model)
    model, inputs, kwargs = (built if isinstance(built, tuple) else (built, None, {}))
    if args.inputs is not None:
        inputs = eval(args.inputs, {"torch": torch})  # the user's own expression, on their own machine
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    if inputs is None:
        raise UsageError(f"give example inputs with --inputs, e.g. --inputs '{example}', "
                         "or have the factory return (model, args, kwargs).")
    return model, inputs, kwargs


def _optimize(args) -> int:
    model, inputs, kwargs = _built(args, "torch.randn(8, 64)")
    train = {"train": True, "eval": False}.get(args.mode)
    options = dict(passes=args.passes, budget_gb=args.budget_gb, profile=args.profile, calibrate=args.calibrate,
                   precision=args.precision, stages=args.stages, train=train, frontend=args.frontend)
    if args.measure:
        return _measure(args, model, inputs, kwargs, options)
    with graphopt_warnings():
        opt = optimize(model, inputs, example_kwargs=kwargs or None, **options, dump_dir=args.dump, verify=args.verify)
    print(cli_text(opt.graphopt_report.to_text()))
    if args.dump:
        print(f"\ndumps: {os.path.abspath(args.dump)}")
    return 0


def _plan(args) -> int:
    """The factory's model built on the meta device, planned for --device: nothing allocated."""
    with torch.device("meta"):
        model, inputs, kwargs = _built(args, "torch.randint(0, 32000, (4, 2048))")
    loss_fn = _load_function(args.loss) if args.loss else None
    with graphopt_warnings():
        found = plan(model, inputs, kwargs or None, budget_gb=args.budget_gb, device=args.device,
                     optimizer=args.optimizer, loss_fn=loss_fn, passes=args.passes, precision=args.precision)
    print(cli_text(str(found)))
    return 0 if args.budget_gb is None or found.fits else 1


def _cache(args) -> int:
    store = PlanStore(args.dir)
    if args.action == "clear":
        print(f"removed {store.clear()} plans from {store.dir}")
    else:
        print(f"{len(store)} plans in {store.dir}")
    return 0


def _check_estimate(args) -> int:
    """The step's estimate against a real step; 1 where they part."""
    model, inputs, kwargs = _built(args, "torch.randn(8, 64)")
    if args.mode:
        model.train(args.mode == "train")
    with graphopt_warnings():
        check = check_estimate(model, inputs, kwargs or None, optimizer=args.optimizer, accumulate=args.accumulate,
                               frontend=args.frontend)
    print(cli_text(str(check)))
    return 0 if check.divergence is None else 1


def _measure(args, model, inputs, kwargs, options) -> int:
    """The model's step against the optimized one's, as the demo measures them."""
    if args.stages:
        raise UsageError("--measure steps the model in one process; a pipeline's stages run across processes: "
                         "leave --stages out to measure, or time the stages with PipelineRunner.")
    if options["train"] is False or (options["train"] is None and not model.training):
        raise UsageError("--measure measures a training step: give --mode train (the model is in eval mode).")
    loss_fn = _load_function(args.loss) if args.loss else None
    if loss_fn is None:
        _check_loss(model, inputs, kwargs)
    options = {k: v for k, v in options.items() if v not in (None, False)}
    dump = args.dump or "graphopt-dump"
    budget = budget_bytes(args.budget_gb) if args.budget_gb else None
    with graphopt_warnings():
        result = measure(model, inputs, kwargs, {"graphopt": options}, loss_fn=loss_fn, budget_bytes=budget,
                         name=args.model, dump_dir=dump,
                         progress=lambda text: print(f"  {text}", file=sys.stderr, flush=True))
    result.write(dump)
    print(result.to_text(refusals=False))
    print(f"written: {', '.join(_written(dump))}")
    for label, why in result.refusals():
        print(f"graphopt: error: {label} refused: {cli_text(why)}", file=sys.stderr)
    if result.refusals():
        return 2
    for line in result.over_budget():
        print(f"graphopt: error: {line.label} measured {size_text(line.peak_bytes)}, over the budget", file=sys.stderr)
        return 1
    return 0


def _check_loss(model, inputs, kwargs) -> None:
    """UsageError, before any optimizing, when the model's output has no scalar loss to step on:
    one forward without gradients, the model's buffers and RNG as before."""
    with trial_run(model, (inputs, kwargs)), torch.no_grad():
        output_loss(model(*inputs, **(kwargs or {})))


def _load_function(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise UsageError(f"loss {spec!r} must be written pkg.module:function (output, *args, **kwargs) -> loss.")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"cannot load {spec!r}: {e}.") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m graphopt",
        description="Rewrite a PyTorch model's graph through graphopt's passes and show what each pass did.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    passes_help = f"pipeline, e.g. 'normalize,cse,dce' (default: {','.join(DEFAULT_PASSES)}; available: {', '.join(sorted(available()))})"

    demo = sub.add_parser("demo", help="a Llama-shaped model's training step, eager against graphopt, measured")
    demo.add_argument("--dump", default="graphopt-dump", help="output directory (default: ./graphopt-dump)")
    demo.add_argument("--device", default="cpu", help="device to run on (default: cpu)")
    demo.add_argument("--record", default=None, metavar="FILE.md",
                      help="also write the run down as markdown: the table, date, machine, torch version, total time "
                           "(make demo writes docs/demo.md)")
    demo.set_defaults(run=_demo)

    opt = sub.add_parser("optimize", help="optimize your own model",
                         description="Example: python -m graphopt optimize mypkg.models:build --inputs 'torch.randn(8, 64)' --dump out")
    opt.add_argument("model", help="pkg.module:factory; the factory returns a model or (model, args, kwargs)")
    opt.add_argument("--inputs", help="Python expression for the example inputs (torch is in scope)")
    opt.add_argument("--passes", default=None, help=passes_help)
    opt.add_argument("--budget-gb", type=float, default=None, help="peak memory budget of a training step, GB (10^9 bytes)")
    opt.add_argument("--profile", action="store_true", help="with --budget-gb: cost recompute by measured node times")
    opt.add_argument("--calibrate", action="store_true", help="with --budget-gb: measure a real step and re-plan if over")
    opt.add_argument("--precision", choices=PRECISIONS, default=None)
    opt.add_argument("--stages", type=int, default=None, help="number of pipeline stages")
    opt.add_argument("--mode", choices=["train", "eval"], default=None, help="build for training or inference (default: the model's mode)")
    opt.add_argument("--frontend", choices=["auto", "fx", "export"], default="auto")
    opt.add_argument("--dump", default=None, help="write pass-by-pass dumps to this directory")
    opt.add_argument("--verify", action="store_true", help="check outputs and gradients against eager after each pass")
    opt.add_argument("--measure", action="store_true",
                     help="step the model and the optimized graph (forward, loss, backward) and print their measured "
                          "peaks and times; writes summary.json, summary.md, memory.png to --dump (default "
                          "./graphopt-dump)")
    opt.add_argument("--loss", default=None, help="with --measure: pkg.module:function(output, *args, **kwargs) "
                     "returning the scalar loss (default: the output's .loss, or the output when it is a scalar)")
    opt.set_defaults(run=_optimize)

    planned = sub.add_parser(
        "plan", help="will a training step fit a device, and with which plan: on the meta device, nothing allocated",
        description="Example: python -m graphopt plan mypkg.models:build_llama --inputs "
                    "'torch.randint(0, 32000, (4, 2048))' --budget-gb 80 --device cuda --optimizer adamw. The factory "
                    "runs under torch.device('meta'), and so does --inputs.")
    planned.add_argument("model", help="pkg.module:factory; the factory returns a model or (model, args, kwargs)")
    planned.add_argument("--inputs", help="Python expression for the example inputs (torch is in scope)")
    planned.add_argument("--budget-gb", type=float, default=None, help="peak memory of a training step, GB (10^9 bytes)")
    planned.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="the device planned for (default: cuda)")
    planned.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "momentum"], default=None,
                         help="count this optimizer's state and step")
    planned.add_argument("--precision", choices=PRECISIONS, default=None)
    planned.add_argument("--passes", default=None, help=passes_help)
    planned.add_argument("--loss", default=None, help="pkg.module:function(output, *args, **kwargs) returning the "
                         "scalar loss (default: the output's .loss, or the output when it is a scalar)")
    planned.set_defaults(run=_plan)

    checked = sub.add_parser(
        "check-estimate", help="the step's memory estimate (what budgets are planned by) against a real step, storage "
                               "by storage: where they first part",
        description="Example: python -m graphopt check-estimate mypkg.models:build --inputs 'torch.randn(8, 64)'. "
                    "Exits 1 where the estimate and the real step part.")
    checked.add_argument("model", help="pkg.module:factory; the factory returns a model or (model, args, kwargs)")
    checked.add_argument("--inputs", help="Python expression for the example inputs (torch is in scope)")
    checked.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "momentum"], default=None,
                         help="count this optimizer's state and step")
    checked.add_argument("--accumulate", action="store_true", help="gradients resident from the start, added into")
    checked.add_argument("--mode", choices=["train", "eval"], default=None, help="(default: the model's mode)")
    checked.add_argument("--frontend", choices=["auto", "fx", "export"], default="auto")
    checked.set_defaults(run=_check_estimate)

    cache = sub.add_parser("cache", help="the plan cache: where it is and how many plans it holds, or empty it",
                           description="Plans optimize() made for a budget, kept for later processes "
                                       "($GRAPHOPT_CACHE_DIR, else ~/.cache/graphopt).")
    cache.add_argument("action", choices=["show", "clear"])
    cache.add_argument("--dir", default=None, help="a cache directory other than the default")
    cache.set_defaults(run=_cache)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except GraphoptError as e:
        print(f"graphopt: error: {cli_text(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
