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


def falcon():
    """Attention and MLP in parallel from one layer norm, multi-query attention (Falcon-7B's layout)."""
    from transformers import FalconConfig, FalconForCausalLM
    return _lm(FalconForCausalLM, FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, multi_query=True, parallel_attn=True,
                                               new_decoder_architecture=False, alibi=False, bias=False,
                                               max_position_embeddings=128, use_cache=False))


def gptj():
    """Parallel attention and MLP, rotary embeddings on part of each head."""
    from transformers import GPTJConfig, GPTJForCausalLM
    return _lm(GPTJForCausalLM, GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                           n_positions=128, use_cache=False, bos_token_id=0, eos_token_id=0))


def bloom():
    """ALiBi position biases instead of position embeddings; its GELU an autograd.Function that
    saves its input only (graphopt keeps it whole, custom_functions.py)."""
    from transformers import BloomConfig, BloomForCausalLM
    return _lm(BloomForCausalLM, BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, use_cache=False))


# Mixture-of-experts decoders, at the decoder's sizes with 4 experts, 2 per token, their experts
# grouped (transformers' default): torch._grouped_mm in eager, transformers' own grouped-matmul
# operator under export.
MOE = dict(num_key_value_heads=2)


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return _lm(MixtralForCausalLM, MixtralConfig(**DECODER, **MOE, num_local_experts=4, num_experts_per_tok=2))


def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return _lm(Qwen2MoeForCausalLM, Qwen2MoeConfig(**DECODER, **MOE, moe_intermediate_size=64, num_experts=4,
                                                   shared_expert_intermediate_size=64, num_experts_per_tok=2,
                                                   decoder_sparse_step=1))


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return _lm(Qwen3MoeForCausalLM, Qwen3MoeConfig(**DECODER, **MOE, moe_intermediate_size=64, num_experts=4,
                                                   num_experts_per_tok=2, decoder_sparse_step=1, head_dim=16))


def olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM
    return _lm(OlmoeForCausalLM, OlmoeConfig(**{**DECODER, "intermediate_size": 64}, **MOE, num_experts=4,
                                             num_experts_per_tok=2))


def deepseek_v3():
    """Multi-head latent attention and a shared expert; its small config routes in one group, and
    its first layer is dense as the released models' are."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return _lm(DeepseekV3ForCausalLM, DeepseekV3Config(**DECODER, num_key_value_heads=4, moe_intermediate_size=64,
                                                       n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                                       n_group=1, topk_group=1, first_k_dense_replace=1,
                                                       kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                                                       qk_nope_head_dim=16, v_head_dim=16))


def gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM
    return _lm(GptOssForCausalLM, GptOssConfig(**{**DECODER, "intermediate_size": 64}, **MOE, num_local_experts=4,
                                               num_experts_per_tok=2, head_dim=16, sliding_window=16,
                                               layer_types=["sliding_attention", "full_attention"]))


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



def whisper():
    """Speech recognition: log-mel features through a convolutional stem and an encoder, a decoder
    trained on the transcript's tokens (-100 on padding), as Whisper is fine-tuned."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    config = WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, max_source_positions=32, max_target_positions=64, use_cache=False,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    features, labels = torch.randn(BATCH, 16, 64), Labels(VOCAB).draw(_tokens(seq=SEQ // 2))
    return Case(WhisperForConditionalGeneration(config), (features,), {"labels": labels},
                kinds={0: Normal(), "labels": Labels(VOCAB)})


def wav2vec2():
    """Audio classification from raw audio (keyword spotting, as transformers' audio-classification
    example fine-tunes it): a convolutional feature encoder (GroupNorm), a transformer over its
    frames with convolutional position embeddings, mean-pooled into a classifier. LayerDrop off: a
    layer skipped by a random draw is Python control flow on a tensor's value, which no graph holds
    (graphopt refuses it)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification
    config = Wav2Vec2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
                            classifier_proj_size=32, num_labels=6, layerdrop=0.0)
    audio = torch.randn(BATCH, 1600)  # 0.1 s at 16 kHz: 79 frames
    return Case(Wav2Vec2ForSequenceClassification(config), (audio,), {"labels": torch.randint(0, 6, (BATCH,))},
                kinds={0: Normal(), "labels": Classes(6)})


def mamba():
    """A state-space language model: selective scans in place of attention (the sequential path
    the model takes without its CUDA kernels)."""
    from transformers import MambaConfig, MambaForCausalLM
    return _lm(MambaForCausalLM, MambaConfig(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2,
                                             expand=2, conv_kernel=4, use_cache=False))


def segformer():
    """Semantic segmentation: a hierarchical encoder with reduced-sequence attention and an
    all-MLP decoder head, trained on per-pixel classes."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation
    config = SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[4, 2],
                             hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                             mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=5)
    return Case(SegformerForSemanticSegmentation(config), (torch.randn(BATCH, 3, 64, 64),),
                {"labels": torch.randint(0, 5, (BATCH, 64, 64))}, kinds={0: Normal(), "labels": Classes(5)})


def vision_encoder_decoder():
    """Image to text (TrOCR's and Donut's form): a ViT encoder, a GPT-2 decoder cross-attending to
    it, trained on the text's tokens."""
    from transformers import GPT2Config, ViTConfig, VisionEncoderDecoderConfig, VisionEncoderDecoderModel
    encoder = ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128)
    decoder = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=128, use_cache=False,
                         add_cross_attention=True, is_decoder=True, bos_token_id=0, eos_token_id=0)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 0, 0
    labels = Labels(VOCAB).draw(_tokens(seq=SEQ // 2))
    return Case(VisionEncoderDecoderModel(config), (torch.randn(BATCH, 3, 32, 32),), {"labels": labels},
                kinds={0: Normal(), "labels": Labels(VOCAB)})

def patchtst():
    """Time-series forecasting: a series cut into patches (unfold), a standard-deviation scaler,
    BatchNorm over patches, a positional encoding that does not train, an MSE loss on the future."""
    from transformers import PatchTSTConfig, PatchTSTForPrediction
    config = PatchTSTConfig(num_input_channels=4, context_length=64, prediction_length=16, patch_length=8,
                            patch_stride=8, d_model=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128)
    return Case(PatchTSTForPrediction(config), (torch.randn(BATCH, 64, 4),),
                {"future_values": torch.randn(BATCH, 16, 4)}, kinds={0: Normal(), "future_values": Normal()})


def clip():
    """A contrastive two-tower model: a text and a vision transformer, CLIP's loss over the batch
    (its targets are torch.arange of the batch's size)."""
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig
    text = CLIPTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                          pad_token_id=0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8)
    config = CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=16)
    return Case(CLIPModel(config), (), {"input_ids": _tokens(seq=16), "pixel_values": torch.randn(BATCH, 3, 32, 32),
                                        "return_loss": True},
                kinds={"input_ids": Tokens(VOCAB), "pixel_values": Normal()})


def videomae():
    """Video classification: tubelets of frames embedded by a 3-d convolution, a ViT over them."""
    from transformers import VideoMAEConfig, VideoMAEForVideoClassification
    config = VideoMAEConfig(image_size=32, patch_size=8, num_channels=3, num_frames=4, tubelet_size=2, hidden_size=64,
                            num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=5)
    return Case(VideoMAEForVideoClassification(config), (torch.randn(BATCH, 4, 3, 32, 32),),
                {"labels": torch.randint(0, 5, (BATCH,))}, kinds={0: Normal(), "labels": Classes(5)})


BUILDERS = {f"hf_{f.__name__}": f for f in (llama, mistral, qwen2, gpt_neox, phi, gpt2, bert, roberta, distilbert,
                                             t5, bart, vit, convnext, bert_classifier, t5_padded, deberta_v2,
                                             mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, gpt_oss,
                                             falcon, gptj, bloom, whisper, wav2vec2, mamba, segformer,
                                             vision_encoder_decoder, patchtst, clip, videomae)}
