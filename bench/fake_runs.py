"""FakeTensor runs and time per optimize() call, per corpus model and configuration.

    python bench/fake_runs.py [--models a,b] [--configs cleanups,budget,inplace_budget,stages,default]

Each FakeTensorMode graphopt opens is one run of the graph on FakeTensors (a forward, or a
forward and backward); torch.export opens its own while tracing, counted apart. A run is
attributed to the graphopt function that opened it. The budget is the corpus's recompute
budget (f = 0.5 of the step's activations, tests/corpus/checks.recompute_budget), chosen
before counting starts.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

MODELS = "hf_llama,hf_gpt2,hf_bert,timm_efficientnet_b0,timm_resnet18,tv_resnet18"
CONFIGS = {
    # the same pipelines whatever optimize()'s defaults are, so that versions compare
    "cleanups": lambda budget: {"passes": "normalize,cse,dce"},
    "budget": lambda budget: {"budget_gb": budget},
    "inplace_budget": lambda budget: {"passes": "normalize,cse,dce,inplace", "budget_gb": budget},
    "stages": lambda budget: {"stages": 2},
    "default": lambda budget: {},  # optimize(model, x): this version's default passes
}


class FakeRunCounter:
    """Counts FakeTensorMode constructions by the graphopt function that asked for them."""

    def __init__(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.cls, self.counts = FakeTensorMode, collections.Counter()
        self.original = FakeTensorMode.__init__

    def __enter__(self):
        counts, original = self.counts, self.original

        def counting(mode, *args, **kwargs):
            counts[_opener()] += 1
            original(mode, *args, **kwargs)

        self.cls.__init__ = counting
        return self

    def __exit__(self, *exc):
        self.cls.__init__ = self.original


def _opener() -> str:
    """The graphopt function that opened the run: the caller of fake_run, or of export."""
    frames = [f for f in traceback.extract_stack()[:-2] if "/graphopt/" in f.filename]
    for f, caller in zip(frames[::-1], frames[-2::-1]):
        if f.name == "fake_run":
            return caller.name
    return "export (tracing)" if any("torch/export" in f.filename for f in traceback.extract_stack()) else \
        (frames[-1].name if frames else "?")


def main(argv=None) -> int:
    import torch

    import graphopt
    from corpus import build
    from corpus.checks import recompute_budget

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    print("| model | config | FakeTensor runs (graphopt) | by function | export's own | optimize() s |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        case = build(name)
        budget = recompute_budget(case)
        for config in args.configs.split(","):
            options = CONFIGS[config](budget)
            with FakeRunCounter() as counter:
                start = time.perf_counter()
                try:
                    graphopt.optimize(case.model, case.args, example_kwargs=case.kwargs, **options)
                    failed = ""
                except graphopt.GraphoptError as e:
                    failed = f" ({type(e).__name__})"
                seconds = time.perf_counter() - start
            export = counter.counts.pop("export (tracing)", 0)
            by = ", ".join(f"{k} {v}" for k, v in sorted(counter.counts.items(), key=lambda kv: -kv[1]))
            print(f"| {name} | {config}{failed} | {sum(counter.counts.values())} | {by} | {export} | {seconds:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
