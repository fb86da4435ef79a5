"""Autocast precision class of each canonical op, as CUDA torch.autocast treats it.

Copied from the installed torch, not guessed:
  - torch/include/ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
    AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (norm), AT_FORALL_PROMOTE;
  - torch/testing/_internal/autocast_test_lists.py (AutocastTestLists, the CUDA lists the autocast
    tests check): cat and stack are listed under torch_expect_builtin_promote (CUDA relies on their
    own type promotion; the CPU autocast registers them, with index_copy, as promote explicitly),
    and methods_fp32 lists __pow__.
Names are canonical op names (mostly the aten names). Composite ops that decompose into listed ops
before autocast sees them take their parts' class: cross_entropy (log_softmax + nll_loss), normalize
(norm), scaled_dot_product_attention's fused kernels. In-place and out= forms never autocast (the
torch.amp docs), so twins are left None by the registry.
"""

LOWER = """
    _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d
    convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
    chain_matmul linalg_multi_dot lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
    _scaled_dot_product_flash_attention scaled_dot_product_attention
    scaled_dot_product_attention_kernel scaled_dot_product_attention_dropout
"""
FP32 = """
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow pow_scalar
    softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm
    nuclear_norm cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
    hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
    multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
    binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp interpolate
    prod softmax log_softmax cumprod cumsum sum norm cross_entropy normalize
"""
PROMOTE = """
    addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add
    cat stack index_copy
"""

PRECISION = {name: cls for cls, names in (("lower", LOWER), ("fp32", FP32), ("promote", PROMOTE))
             for name in names.split()}
