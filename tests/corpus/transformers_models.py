"""transformers models at small random configs, trained on their own loss (labels given).

Configs keep the library's defaults (dropout, activations, attention implementation) but
for sizes, and `use_cache=False`: a training step has no use for the key/value cache.
Inputs are given as transformers' users give them: a causal LM's labels are its input_ids
(the same tensor), a masked LM's -100 but where a token is masked, a classifier's and a
seq2seq model's padded rows come with an attention_mask.
"""
from __future__ import annotations

import torch

from .case import Case, Classes, Labels, Normal, PaddingMask, Tokens

LIBRARY = "transformers"
BATCH, SEQ, VOCAB = 2, 32, 256
DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=128, use_cache=False)


def _tokens(batch=BATCH, seq=SEQ):
    return torch.randint(0, VOCAB, (batch, seq))


def _lm(model_cls, config) -> Case:
    ids = _tokens()
    return Case(model_cls(config), (ids,), {"labels": ids}, kinds={0: Tokens(VOCAB), "labels": Labels(VOCAB)})


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return _lm(LlamaForCausalLM, LlamaConfig(**DECODER, num_key_value_heads=2))


def mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return _lm(MistralForCausalLM, MistralConfig(**DECODER, num_key_value_heads=2, sliding_window=16))


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _lm(Qwen2ForCausalLM, Qwen2Config(**DECODER, num_key_value_heads=2))


def gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return _lm(GPTNeoXForCausalLM, GPTNeoXConfig(**DECODER, rotary_pct=0.25))


def phi():
    from transformers import PhiConfig, PhiForCausalLM
    return _lm(PhiForCausalLM, PhiConfig(**DECODER, partial_rotary_factor=0.5))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return _lm(GPT2LMHeadModel, GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=128,
                                           use_cache=False, bos_token_id=0, eos_token_id=0))


ENCODER = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               max_position_embeddings=128)


def _masked_lm(model_cls, config) -> Case:
    ids = _tokens()
    labels = torch.full_like(ids, -100)
    labels[:, ::4] = ids[:, ::4]  # a masked-LM loss on every fourth token
    return Case(model_cls(config), (ids,), {"attention_mask": torch.ones_like(ids), "labels": labels},
                kinds={0: Tokens(VOCAB), "attention_mask": PaddingMask(), "labels": Labels(VOCAB, ignored=0.75)})


def bert():
    from transformers import BertConfig, BertForMaskedLM
    return _masked_lm(BertForMaskedLM, BertConfig(**ENCODER))


def roberta():
    from transformers import RobertaConfig, RobertaForMaskedLM
    return _masked_lm(RobertaForMaskedLM, RobertaConfig(**ENCODER, pad_token_id=1))


def distilbert():
    from transformers import DistilBertConfig, DistilBertForSequenceClassification
    config = DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                              max_position_embeddings=128, num_labels=3)
    ids = _tokens()
    return Case(DistilBertForSequenceClassification(config), (ids,),
                {"attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 3, (BATCH,))},
                kinds={0: Tokens(VOCAB), "attention_mask": PaddingMask(), "labels": Classes(3)})


def bert_classifier():
    """A sentence classifier fine-tuned on padded batches, as the GLUE examples train one."""
    from transformers import BertConfig, BertForSequenceClassification
    ids = _tokens()
    return Case(BertForSequenceClassification(BertConfig(**ENCODER, num_labels=3)), (ids,),
                {"attention_mask": PaddingMask().draw(ids), "labels": torch.randint(0, 3, (BATCH,))},
                kinds={0: Tokens(VOCAB), "attention_mask": PaddingMask(), "labels": Classes(3)})


def deberta_v2():
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM
    return _masked_lm(DebertaV2ForMaskedLM, DebertaV2Config(**ENCODER))


def _seq2seq(model_cls, config) -> Case:
    ids, labels = _tokens(), _tokens(seq=SEQ // 2)
    return Case(model_cls(config), (ids,), {"labels": labels}, kinds={0: Tokens(VOCAB), "labels": Labels(VOCAB)})


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    return _seq2seq(T5ForConditionalGeneration, T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, use_cache=False,
        decoder_start_token_id=0))


def t5_padded():
    """T5 on padded source sentences, as translation and summarization fine-tuning runs it: the
    source's attention_mask, the labels' padding -100."""
    from transformers import T5Config, T5ForConditionalGeneration
    model = T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, use_cache=False,
        decoder_start_token_id=0))
    ids, labels = _tokens(), Labels(VOCAB).draw(_tokens(seq=SEQ // 2))
    return Case(model, (ids,), {"attention_mask": PaddingMask().draw(ids), "labels": labels},
                kinds={0: Tokens(VOCAB), "attention_mask": PaddingMask(), "labels": Labels(VOCAB)})


def bart():
    from transformers import BartConfig, BartForConditionalGeneration
    return _seq2seq(BartForConditionalGeneration, BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128,
        use_cache=False, bos_token_id=0, eos_token_id=0))


def vit():
    from transformers import ViTConfig, ViTForImageClassification
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, num_labels=10)
    return Case(ViTForImageClassification(config), (torch.randn(BATCH, 3, 32, 32),),
                {"labels": torch.randint(0, 10, (BATCH,))}, kinds={0: Normal(), "labels": Classes(10)})


def convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification
    config = ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10)
    return Case(ConvNextForImageClassification(config), (torch.randn(BATCH, 3, 64, 64),),
                {"labels": torch.randint(0, 10, (BATCH,))}, kinds={0: Normal(), "labels": Classes(10)})


BUILDERS = {f"hf_{f.__name__}": f for f in (llama, mistral, qwen2, gpt_neox, phi, gpt2, bert, roberta, distilbert,
                                             t5, bart, vit, convnext, bert_classifier, t5_padded, deberta_v2)}
