"""Command line: `python -m graphopt demo` and `python -m graphopt optimize pkg.module:factory`."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch

from .api import DEFAULT_PASSES, optimize
from .errors import GraphoptError, UsageError
from .passes import available
from .precisions import PRECISIONS
from .testing import zoo


def _demo(args) -> int:
    torch.manual_seed(0)
    model, inputs, kwargs = zoo.gpt(batch=4, seq=64, layers=4, dim=128, heads=4)
    params = sum(p.numel() for p in model.parameters())
    print(f"graphopt demo: a {len(model.blocks)}-layer GPT ({params / 1e6:.2f} M parameters), "
          f"batch {inputs[0].shape[0]} x {inputs[0].shape[1]} tokens, training step on CPU")
    start = time.perf_counter()
    opt = optimize(model, inputs, example_kwargs=kwargs, passes=args.passes, dump_dir=args.dump, verify=True)
    print(f"optimized in {time.perf_counter() - start:.2f} s\n")
    print(opt.graphopt_report.to_text())
    torch.manual_seed(1)
    eager = model(*inputs, **kwargs).loss
    torch.manual_seed(1)
    loss = opt(*inputs, **kwargs).loss
    loss.backward()
    print(f"\nloss: eager {eager.item():.6f}, graphopt {loss.item():.6f}; backward ran, "
          f"{sum(p.grad is not None for p in model.parameters())} parameter gradients")
    print(f"dumps: {os.path.abspath(args.dump)} (summary.md, one .py/.txt/.diff per pass that changed the graph)")
    return 0


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


def _optimize(args) -> int:
    built = _load(args.model)
    model, inputs, kwargs = (built if isinstance(built, tuple) else (built, None, {}))
    if args.inputs is not None:
        inputs = eval(args.inputs, {"torch": torch})  # the user's own expression, on their own machine
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    if inputs is None:
        raise UsageError("give example inputs with --inputs, e.g. --inputs 'torch.randn(8, 64)', "
                         "or have the factory return (model, args, kwargs).")
    train = {"train": True, "eval": False}.get(args.mode)
    opt = optimize(model, inputs, example_kwargs=kwargs or None, passes=args.passes, budget_gb=args.budget_gb,
                   profile=args.profile, calibrate=args.calibrate, precision=args.precision, stages=args.stages,
                   train=train, frontend=args.frontend,
                   dump_dir=args.dump, verify=args.verify)
    print(opt.graphopt_report.to_text())
    if args.dump:
        print(f"\ndumps: {os.path.abspath(args.dump)}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m graphopt",
        description="Rewrite a PyTorch model's graph through graphopt's passes and show what each pass did.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    passes_help = f"pipeline, e.g. 'normalize,cse,dce' (default: {','.join(DEFAULT_PASSES)}; available: {', '.join(sorted(available()))})"

    demo = sub.add_parser("demo", help="optimize the built-in GPT on CPU and write dumps")
    demo.add_argument("--dump", default="graphopt-dump", help="dump directory (default: ./graphopt-dump)")
    demo.add_argument("--passes", default=None, help=passes_help)
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
    opt.set_defaults(run=_optimize)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except GraphoptError as e:
        print(f"graphopt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
