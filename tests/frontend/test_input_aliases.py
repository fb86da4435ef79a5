"""Inputs that share storage (graphopt/frontend/input_aliases.py): transformers' `labels=input_ids`, traced
as two inputs, is right on every later batch; a model that writes into an aliased input is refused."""
import pytest
import torch

import graphopt
from graphopt.errors import UsageError

from conftest import assert_same_step

VOCAB, ROWS, SEQ = 128, 2, 16


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=64,
                                      use_cache=False, bos_token_id=0, eos_token_id=0))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, use_cache=False))


def _bert():
    from transformers import BertConfig, BertForMaskedLM
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=128))


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=1,
                                               num_heads=4, use_cache=False, decoder_start_token_id=0))


MODELS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert, "t5": _t5}


def _batches():
    """The example (its labels the input_ids tensor itself) and a next batch: other ids, labels
    drawn apart from them, and the same labels with -100 at a quarter of the positions."""
    ids, new_ids, labels = (torch.randint(0, VOCAB, (ROWS, SEQ)) for _ in range(3))
    ignored = labels.masked_fill(torch.rand(ROWS, SEQ) < 0.25, -100)
    return ids, new_ids, labels, ignored


@pytest.mark.parametrize("name", MODELS)
def test_labels_given_as_the_input_ids_are_an_input_of_their_own(name):
    model = MODELS[name]()
    ids, new_ids, labels, ignored = _batches()
    opt = graphopt.optimize(model, (ids,), example_kwargs={"labels": ids})
    assert opt.meta["graphopt_frontend"] == "export"
    assert_same_step(model, opt, (new_ids,), {"labels": labels}, exact=False)
    assert_same_step(model, opt, (new_ids,), {"labels": ignored}, exact=False)
    assert_same_step(model, opt, (new_ids,), {"labels": new_ids}, exact=False)  # aliased again, as trained
    with pytest.raises(UsageError, match="labels: int64.* -> None"):
        opt(new_ids, labels=None)


def test_the_lazy_form_and_train_step_take_the_first_call_apart_too():
    model = _gpt2()
    ids, new_ids, labels, ignored = _batches()
    lazy = graphopt.optimize(model)
    lazy(ids, labels=ids)
    assert_same_step(model, lazy, (new_ids,), {"labels": ignored}, exact=False)
    assert lazy(new_ids, labels=None).loss is None  # another kind of call: a graph of its own

    step = graphopt.train_step(model, (ids,), example_kwargs={"labels": ids})
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    got = step(new_ids, labels=ignored)
    got_grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    expected = model(new_ids, labels=ignored).loss
    expected.backward()
    torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=0)
    for g, p in zip(got_grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
