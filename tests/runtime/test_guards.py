"""The checks optimize() installs on its result (runtime/guards.py): train/eval mode among them."""
import pytest
import torch

import graphopt
from graphopt.testing import zoo


def test_mode_is_guarded():
    model, args, kwargs = zoo.gpt()
    opt = graphopt.optimize(model, args, example_kwargs=kwargs)
    opt.eval()
    with pytest.raises(graphopt.ModeError, match="train=False"):
        opt(*args, **kwargs)
    opt.train()
    opt(*args, **kwargs)
    model.eval()  # the original shares its modules with the optimized one
    with pytest.raises(graphopt.ModeError):
        opt(*args, **kwargs)


def test_inference_build_with_train_false():
    model, args, kwargs = zoo.gpt()
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, train=False)
    assert not model.training and not opt.training
    with torch.no_grad():
        assert torch.equal(opt(*args, **kwargs).logits, model(*args, **kwargs).logits)


def test_exported_module_mode_guard():
    pytest.importorskip("transformers")
    model, args, kwargs = zoo.hf_bert()
    opt = graphopt.optimize(model, args, example_kwargs=kwargs, train=True)
    opt.eval()  # allowed, unlike a bare ExportedProgram.module()
    with pytest.raises(graphopt.ModeError):
        opt(*args, **kwargs)
