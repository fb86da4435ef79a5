"""Every way a graph can spell each canonical op.

Tokens: `torch.X` `F.X` `nn.X` (module class) `linalg.X` `special.X` `op.X` (python operator)
`hop.X` (higher-order op) `.X` (Tensor method, fx call_method) `aten.X` (the packet and all its
overloads) `aten.X.overload` (one overload; wins over its packet's claim). `*` stands for
`torch.N .N aten.N` of the op's own name N (and `F.N` when N is an in-place twin, like F.relu_).
A trailing `~` marks a reflected spelling whose first two operands come swapped (x.__rsub__(2) is
2 - x). Tokens this torch lacks are skipped. In-place twins without a row here are spelled `*`.
"""
import torch

SPELLINGS = {
    # arithmetic
    "add": "* op.add .__add__ .__radd__~",
    "add_": "* op.iadd .__iadd__",
    "sub": "* torch.subtract .subtract op.sub .__sub__ .__rsub__~ torch.rsub~ aten.rsub~",
    "sub_": "* .subtract_ op.isub .__isub__",
    "mul": "* torch.multiply .multiply op.mul .__mul__ .__rmul__~",
    "mul_": "* .multiply_ op.imul .__imul__",
    "div": ("* torch.divide torch.true_divide .divide .true_divide op.truediv .__truediv__ .__rtruediv__~"
            " .__div__ .__rdiv__~"),
    "div_": "* .divide_ .true_divide_ op.itruediv .__itruediv__ .__idiv__",
    "div_floor": "torch.floor_divide .floor_divide aten.floor_divide op.floordiv .__floordiv__ .__rfloordiv__~",
    "div_floor_": ".floor_divide_ aten.floor_divide_ op.ifloordiv .__ifloordiv__",
    "remainder": "* op.mod .__mod__ .__rmod__~",
    "remainder_": "* op.imod .__imod__",
    "fmod": "*",
    "pow": "* op.pow .__pow__ .__rpow__~",
    "pow_": "* op.ipow .__ipow__",
    "pow_scalar": "aten.pow.Tensor_Scalar",
    "addcmul": "*",
    "addcdiv": "*",
    "neg": "* torch.negative .negative op.neg .__neg__",
    "abs": "* torch.absolute .absolute op.abs .__abs__",
    "sign": "*", "reciprocal": "*", "square": "*", "sqrt": "*", "rsqrt": "*",
    "exp": "*", "expm1": "* special.expm1", "log": "*", "log1p": "* special.log1p",
    "log2": "*", "log10": "*", "sin": "*", "cos": "*",
    "tanh": "* F.tanh nn.Tanh",
    "sigmoid": "* F.sigmoid special.expit nn.Sigmoid",
    "erf": "* special.erf",
    "floor": "*", "ceil": "*", "trunc": "* torch.fix .fix", "round": "* special.round",
    # activations
    "relu": "* F.relu nn.ReLU",
    "relu6": "* F.relu6 nn.ReLU6",
    "hardtanh": "* F.hardtanh nn.Hardtanh",
    "leaky_relu": "* F.leaky_relu nn.LeakyReLU",
    "elu": "* F.elu nn.ELU",
    "gelu": "* F.gelu nn.GELU",
    "silu": "* F.silu nn.SiLU",
    "mish": "* F.mish nn.Mish",
    "softplus": "* F.softplus nn.Softplus",
    "hardsigmoid": "* F.hardsigmoid nn.Hardsigmoid",
    "hardswish": "* F.hardswish nn.Hardswish",
    # clamping, selection, comparison, logic
    "clamp": "* torch.clip .clip aten.clip",
    "clamp_": "* torch.clip_ .clip_ aten.clip_",
    "clamp_min": "*", "clamp_max": "*",
    "maximum": "* aten.max.other",
    "minimum": "* aten.min.other",
    "where": "*",
    "masked_fill": "*",
    "eq": "* op.eq .__eq__",
    "ne": "* torch.not_equal .not_equal op.ne .__ne__",
    "lt": "* torch.less .less op.lt .__lt__",
    "le": "* torch.less_equal .less_equal op.le .__le__",
    "gt": "* torch.greater .greater op.gt .__gt__",
    "ge": "* torch.greater_equal .greater_equal op.ge .__ge__",
    "logical_and": "*", "logical_or": "*", "logical_xor": "*", "logical_not": "*",
    "isnan": "*", "isinf": "*", "isfinite": "*",
    "bitwise_and": "* op.and_ .__and__ .__rand__~ aten.__and__",
    "bitwise_or": "* op.or_ .__or__ .__ror__~ aten.__or__",
    "bitwise_xor": "* op.xor .__xor__ .__rxor__~ aten.__xor__",
    "bitwise_not": "* op.invert op.inv .__invert__",
    "bitwise_and_": "* op.iand .__iand__ aten.__iand__",
    "bitwise_or_": "* op.ior .__ior__ aten.__ior__",
    "bitwise_xor_": "* op.ixor .__ixor__ aten.__ixor__",
    "to_dtype": ("aten._to_copy aten.to .to .type_as aten.type_as"
                 " .float .half .bfloat16 .double .int .long .short .bool .char .byte"),
    "to_device": ".cpu .cuda",
    # views
    "view": "* aten._unsafe_view",
    "reshape": "*", "view_as": "*", "reshape_as": "*",
    "flatten": "* nn.Flatten",
    "unflatten": "* nn.Unflatten",
    "unsqueeze": "*", "squeeze": "*", "permute": "*",
    "transpose": "* torch.swapaxes torch.swapdims .swapaxes .swapdims aten.swapaxes aten.swapdims",
    "t": "*", "numpy_T": "aten.numpy_T",
    "movedim": "* torch.moveaxis .moveaxis aten.moveaxis",
    "expand": "*", "expand_as": "*",
    "slice": "aten.slice",
    "select": "*", "narrow": "*",
    "split": "* aten.split_with_sizes .split_with_sizes",
    "chunk": "*", "unbind": "*", "unfold": ".unfold aten.unfold", "diagonal": "*", "as_strided": "*",
    "alias": "* aten.lift_fresh nn.Identity",
    "detach": "*", "contiguous": "*",
    "getitem": "op.getitem .__getitem__",
    "setitem": "op.setitem .__setitem__",
    # reductions
    "sum": "*", "mean": "*", "prod": "*", "amax": "*", "amin": "*",
    "max": "*", "min": "*",
    "max_dim": "aten.max.dim",
    "min_dim": "aten.min.dim",
    "argmax": "*", "argmin": "*", "all": "*", "any": "*",
    "var": "*", "std": "*", "var_mean": "*", "std_mean": "*",
    "norm": "* linalg.vector_norm aten.linalg_vector_norm",
    "logsumexp": "* special.logsumexp",
    "cumsum": "*", "cumprod": "*",
    "max_pool1d": "* F.max_pool1d nn.MaxPool1d",
    "max_pool2d": "* F.max_pool2d nn.MaxPool2d",
    "max_pool3d": "* F.max_pool3d nn.MaxPool3d",
    "max_pool2d_with_indices": "* F.max_pool2d_with_indices",
    "max_pool3d_with_indices": "* F.max_pool3d_with_indices",
    "avg_pool1d": "* F.avg_pool1d nn.AvgPool1d",
    "avg_pool2d": "* F.avg_pool2d nn.AvgPool2d",
    "avg_pool3d": "* F.avg_pool3d nn.AvgPool3d",
    "adaptive_avg_pool1d": "* F.adaptive_avg_pool1d nn.AdaptiveAvgPool1d",
    "adaptive_avg_pool2d": "* F.adaptive_avg_pool2d nn.AdaptiveAvgPool2d aten._adaptive_avg_pool2d",
    "adaptive_avg_pool3d": "* F.adaptive_avg_pool3d nn.AdaptiveAvgPool3d aten._adaptive_avg_pool3d",
    # normalizations
    "softmax": "* F.softmax special.softmax nn.Softmax aten._softmax",
    "log_softmax": "* F.log_softmax special.log_softmax nn.LogSoftmax aten._log_softmax",
    "layer_norm": "* F.layer_norm nn.LayerNorm",
    "native_layer_norm": "*",
    "rms_norm": "* F.rms_norm nn.RMSNorm",
    "group_norm": "* F.group_norm nn.GroupNorm",
    "native_group_norm": "*",
    "instance_norm": "* F.instance_norm nn.InstanceNorm1d nn.InstanceNorm2d nn.InstanceNorm3d",
    "normalize": "F.normalize",
    "batch_norm": "* F.batch_norm nn.BatchNorm1d nn.BatchNorm2d nn.BatchNorm3d",
    "native_batch_norm": ("* aten._native_batch_norm_legit aten._native_batch_norm_legit_no_training"
                          " aten._native_batch_norm_legit_functional"),
    # matmuls
    "matmul": "* op.matmul .__matmul__ .__rmatmul__~",
    "grouped_mm": "torch._grouped_mm aten._grouped_mm F.grouped_mm",
    "mm": "*", "bmm": "*", "mv": "*", "dot": "*", "outer": "* torch.ger .ger",
    "addmm": "*", "addmv": "*", "baddbmm": "*", "addbmm": "*",
    "linear": "* F.linear nn.Linear",
    "einsum": "*", "tensordot": "*",
    "conv1d": "* F.conv1d nn.Conv1d",
    "conv2d": "* F.conv2d nn.Conv2d",
    "conv3d": "* F.conv3d nn.Conv3d",
    "conv_transpose1d": "* F.conv_transpose1d nn.ConvTranspose1d",
    "conv_transpose2d": "* F.conv_transpose2d nn.ConvTranspose2d",
    "conv_transpose3d": "* F.conv_transpose3d nn.ConvTranspose3d",
    "convolution": "* aten._convolution",
    "scaled_dot_product_attention": "F.scaled_dot_product_attention aten.scaled_dot_product_attention",
    "scaled_dot_product_attention_kernel": (
        "aten._scaled_dot_product_flash_attention aten._scaled_dot_product_efficient_attention"
        " aten._scaled_dot_product_flash_attention_for_cpu aten._scaled_dot_product_cudnn_attention"),
    # losses
    "cross_entropy": "F.cross_entropy nn.CrossEntropyLoss aten.cross_entropy_loss",
    "nll_loss": "* F.nll_loss nn.NLLLoss",
    "mse_loss": "* F.mse_loss nn.MSELoss",
    "l1_loss": "* F.l1_loss nn.L1Loss",
    "smooth_l1_loss": "* F.smooth_l1_loss nn.SmoothL1Loss",
    "huber_loss": "* F.huber_loss nn.HuberLoss",
    "binary_cross_entropy": "* F.binary_cross_entropy nn.BCELoss",
    "binary_cross_entropy_with_logits": "* F.binary_cross_entropy_with_logits nn.BCEWithLogitsLoss",
    "kl_div": "* F.kl_div nn.KLDivLoss",
    # creation and random
    "arange": "*", "linspace": "*", "eye": "*", "zeros": "*", "ones": "*", "empty": "*", "full": "*",
    "zeros_like": "*", "ones_like": "*", "empty_like": "*", "full_like": "*",
    "new_zeros": "*", "new_ones": "*", "new_empty": "*", "new_full": "*",
    "scalar_tensor": "*", "tensor": "torch.tensor torch.as_tensor", "fill": "*", "zero": "*",
    "dropout": "* F.dropout nn.Dropout",
    "native_dropout": "*",
    "feature_dropout": "* F.dropout1d F.dropout2d F.dropout3d nn.Dropout1d nn.Dropout2d nn.Dropout3d",
    "alpha_dropout": "* F.alpha_dropout nn.AlphaDropout",
    "feature_alpha_dropout": "* F.feature_alpha_dropout nn.FeatureAlphaDropout",
    "bernoulli": "*", "multinomial": "*", "normal": "*", "uniform": "aten.uniform",
    "rand": "*", "randn": "*", "randint": "*", "randperm": "*",
    "rand_like": "*", "randn_like": "*", "randint_like": "*",
    # other
    "cat": "* torch.concat torch.concatenate aten.concat aten.concatenate",
    "stack": "*", "gather": "*", "index_select": "*",
    "index": "aten.index aten._unsafe_index",
    "index_put": "* aten._unsafe_index_put",
    "index_add": "*", "index_copy": "*", "scatter": "*", "scatter_add": "*",
    "masked_scatter": "*", "masked_select": "*", "nonzero": "*",
    "diff": "*", "triu": "*", "tril": "*", "repeat": "*", "repeat_interleave": "aten.repeat_interleave.self_int", "tile": "*", "flip": "*", "roll": "*",
    "pad": "F.pad aten.pad aten.constant_pad_nd torch.constant_pad_nd",
    "one_hot": "F.one_hot aten.one_hot",
    "sort": "*", "argsort": "*", "topk": "*", "histc": "*", "bincount": "*",
    "interpolate": ("F.interpolate nn.Upsample aten.upsample_nearest1d aten.upsample_nearest2d"
                    " aten.upsample_nearest3d aten.upsample_linear1d aten.upsample_bilinear2d"
                    " aten.upsample_trilinear3d aten.upsample_bicubic2d"),
    "embedding": "* F.embedding nn.Embedding",
    "clone": "* aten.lift_fresh_copy",
    "copy": "aten.copy",
    "size": ".size aten.sym_size aten.size",
    "numel": "* aten.sym_numel .nelement",
    "dim": ".dim .ndimension",
    "item": ".item aten._local_scalar_dense",
    "assert_tensor_metadata": "aten._assert_tensor_metadata",
    "assert_async": "torch._assert_async aten._assert_async",
    "assert_scalar": "aten._assert_scalar",
    "assert": "torch._assert",
    "sym_constrain_range": "aten.sym_constrain_range",
    "sym_constrain_range_for_size": "aten.sym_constrain_range_for_size",
    "set_grad_enabled": "torch._C._set_grad_enabled",
    "enter_autocast": "torch.amp.autocast_mode._enter_autocast",
    "exit_autocast": "torch.amp.autocast_mode._exit_autocast",
    "wrap_with_set_grad_enabled": "hop.wrap_with_set_grad_enabled",
    "wrap_with_autocast": "hop.wrap_with_autocast",
}

# Spellings that imply a param the call does not pass.
FIXED = {
    ".float": {"dtype": torch.float32}, ".half": {"dtype": torch.float16}, ".bfloat16": {"dtype": torch.bfloat16},
    ".double": {"dtype": torch.float64}, ".int": {"dtype": torch.int32}, ".long": {"dtype": torch.int64},
    ".short": {"dtype": torch.int16}, ".bool": {"dtype": torch.bool}, ".char": {"dtype": torch.int8},
    ".byte": {"dtype": torch.uint8}, ".cpu": {"device": torch.device("cpu")}, ".cuda": {"device": torch.device("cuda")},
    "aten.upsample_nearest1d": {"mode": "nearest"}, "aten.upsample_nearest2d": {"mode": "nearest"},
    "aten.upsample_nearest3d": {"mode": "nearest"}, "aten.upsample_linear1d": {"mode": "linear"},
    "aten.upsample_bilinear2d": {"mode": "bilinear"}, "aten.upsample_trilinear3d": {"mode": "trilinear"},
    "aten.upsample_bicubic2d": {"mode": "bicubic"},
}

# Spelling names that differ from the canonical ones, per op (the generic self/input -> x, other -> y
# is applied to every op).
RENAMES = {
    "pow": {"exponent": "y"},
    "where": {"condition": "cond"},
    "addcmul": {"tensor1": "y", "tensor2": "z"},
    "addcdiv": {"tensor1": "y", "tensor2": "z"},
    "interpolate": {"output_size": "size", "scale_factors": "scale_factor"},
}

# nn.Module attributes that carry the op's params (and module-owned operands such as weights);
# "param=attr" where the names differ. Forward arguments bind like a function's.
CONV = "weight bias stride padding dilation groups padding_mode"
MODULE_ATTRS = {
    "ReLU": "inplace", "ReLU6": "inplace", "SiLU": "inplace", "Mish": "inplace", "Hardsigmoid": "inplace",
    "Hardswish": "inplace", "Hardtanh": "min_val max_val inplace", "LeakyReLU": "negative_slope inplace",
    "ELU": "alpha inplace", "GELU": "approximate", "Softplus": "beta threshold",
    "Softmax": "dim", "LogSoftmax": "dim", "Flatten": "start_dim end_dim", "Unflatten": "dim sizes=unflattened_size",
    "Dropout": "p train=training inplace", "Dropout1d": "p train=training inplace",
    "Dropout2d": "p train=training inplace", "Dropout3d": "p train=training inplace",
    "AlphaDropout": "p train=training inplace", "FeatureAlphaDropout": "p train=training inplace",
    "Linear": "weight bias",
    "Conv1d": CONV, "Conv2d": CONV, "Conv3d": CONV,
    "ConvTranspose1d": CONV + " output_padding", "ConvTranspose2d": CONV + " output_padding",
    "ConvTranspose3d": CONV + " output_padding",
    "LayerNorm": "normalized_shape weight bias eps", "RMSNorm": "normalized_shape weight eps",
    "GroupNorm": "num_groups weight bias eps",
    "Embedding": "weight padding_idx max_norm norm_type scale_grad_by_freq sparse",
    "MaxPool1d": "kernel_size stride padding dilation ceil_mode return_indices",
    "MaxPool2d": "kernel_size stride padding dilation ceil_mode return_indices",
    "MaxPool3d": "kernel_size stride padding dilation ceil_mode return_indices",
    "AvgPool1d": "kernel_size stride padding ceil_mode count_include_pad",
    "AvgPool2d": "kernel_size stride padding ceil_mode count_include_pad divisor_override",
    "AvgPool3d": "kernel_size stride padding ceil_mode count_include_pad divisor_override",
    "AdaptiveAvgPool1d": "output_size", "AdaptiveAvgPool2d": "output_size", "AdaptiveAvgPool3d": "output_size",
    "Upsample": "size scale_factor mode align_corners recompute_scale_factor",
    "CrossEntropyLoss": "weight ignore_index reduction label_smoothing", "NLLLoss": "weight ignore_index reduction",
    "MSELoss": "reduction", "L1Loss": "reduction", "SmoothL1Loss": "reduction beta", "HuberLoss": "reduction delta",
    "BCELoss": "weight reduction", "BCEWithLogitsLoss": "weight reduction pos_weight",
    "KLDivLoss": "reduction log_target",
}


def _batch_norm_attrs(m):
    # what _BatchNorm.forward passes to F.batch_norm
    stats = not m.training or m.track_running_stats
    return dict(weight=m.weight, bias=m.bias, eps=m.eps, momentum=m.momentum,
                running_mean=m.running_mean if stats else None, running_var=m.running_var if stats else None,
                training=m.training or (m.running_mean is None and m.running_var is None))


def _instance_norm_attrs(m):
    # what _InstanceNorm.forward passes to F.instance_norm
    return dict(weight=m.weight, bias=m.bias, eps=m.eps, momentum=m.momentum, running_mean=m.running_mean,
                running_var=m.running_var, use_input_stats=m.training or not m.track_running_stats)


MODULE_ATTR_FNS = {**{f"BatchNorm{d}d": _batch_norm_attrs for d in (1, 2, 3)},
                   **{f"InstanceNorm{d}d": _instance_norm_attrs for d in (1, 2, 3)}}

# Tensor methods that take sizes as varargs: x.view(2, 3) means x.view((2, 3)).
VARARG_METHODS = {"view", "reshape", "expand", "permute", "repeat", "tile", "flip", "new_zeros", "new_ones",
                  "new_empty"}

# Values of spelling-only arguments that change nothing, so bind can ignore them.
NEUTRAL = {
    "layout": (None, torch.strided), "pin_memory": (None, False), "non_blocking": (False,),
    "memory_format": (None, torch.preserve_format), "copy": (False, True), "_stacklevel": None,
    "generator": (None,), "requires_grad": (False,), "padding_mode": ("zeros",), "max_norm": (None,),
    "norm_type": None, "cudnn_enable": None, "cudnn_enabled": None, "implicit": None, "sparse_grad": (False,),
    "sparse": (False,), "scale_grad_by_freq": None, "half_to_float": (False,), "return_indices": (False,),
}
