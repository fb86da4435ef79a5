"""transformers models at their default configs (use_cache=True), in training and in eval, the
way a user builds them: the optimized module returns what the model returns, cache included."""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import graphopt

transformers = pytest.importorskip("transformers")


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32,
                                                                  n_layer=2, n_head=2))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=100, d_model=32, d_ff=64,
                                                                         num_layers=2, num_heads=2, d_kv=16))


MODELS = {"gpt2": _gpt2, "llama": _llama, "t5": _t5}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", MODELS)
def test_default_config_with_its_cache(name, mode):
    torch.manual_seed(0)
    model = MODELS[name]()
    assert model.config.use_cache  # the default a user gets
    getattr(model, mode)()
    ids = torch.randint(0, 100, (2, 8))
    kwargs = {"labels": ids, **({"decoder_input_ids": ids} if name == "t5" else {})}
    opt = graphopt.optimize(model, (ids,), example_kwargs=kwargs)

    def step(module):
        torch.manual_seed(1)
        out = module(ids, **kwargs)
        out.loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out, grads

    (got, got_grads), (want, want_grads) = step(opt), step(model)
    assert type(got.past_key_values) is type(want.past_key_values)
    got_leaves, want_leaves = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
