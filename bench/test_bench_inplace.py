"""The inplace pass on every zoo model: ops rewritten, and the measured peak of a training
step and of an inference forward, against the same graph without the pass (same run)."""
import pytest
import torch

import graphopt
from graphopt.analysis.memory import measure_peak, measure_step
from graphopt.testing import zoo

MODELS = {
    "mlp": lambda: zoo.mlp(batch=512, width=256, depth=4),
    "convnet": lambda: zoo.convnet(batch=16, size=32, blocks=6),
    "gpt": lambda: zoo.gpt(batch=8, seq=64, layers=4),
    "two_heads": lambda: zoo.two_heads("dataclass", batch=2048, dim=64),
}


def _forward_peak(module, args, kwargs):
    with torch.no_grad():
        return measure_peak(lambda: module(*args, **kwargs), module, *args, *kwargs.values())


@pytest.mark.parametrize("name", MODELS)
def test_inplace_memory(benchmark, quick, figures, name):
    if quick and name != "convnet":
        pytest.skip("quick mode runs one model")
    model, args, kwargs = MODELS[name]()
    row = {}
    for mode in ("train", "eval"):
        model.train(mode == "train")
        plain = graphopt.trace(model, args, kwargs)
        opt = graphopt.optimize(model, args, example_kwargs=kwargs, passes="normalize,cse,dce,inplace")
        measure = measure_step if mode == "train" else _forward_peak
        before, after = measure(plain, args, kwargs), measure(opt, args, kwargs)
        assert after <= before
        row[f"{mode}_rewritten"] = len(opt.graphopt_report.passes[-1].stats["rewritten"])
        row[f"{mode}_peak_after_over_before"] = round(after / before, 3)
    benchmark.pedantic(lambda: graphopt.optimize(model, args, example_kwargs=kwargs, passes="inplace"),
                       rounds=1, iterations=1)
    figures(**row)
