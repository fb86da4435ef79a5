"""Ops that reduce along a dimension: reductions, normalizations, matmuls and losses, the ops that
do most of a model's arithmetic.

softmax and log_softmax are kind "normalization": like layer_norm they reduce along a dim and
broadcast back, keeping the input's shape, which is what recompute and fusion decisions care about.
Pools are reductions over windows.
"""
from .schema import explicit, ref

REDUCTIONS = {
    "sum": ref("aten.sum.dim_IntList"),
    "mean": ref("aten.mean.dim"),
    "prod": ref("aten.prod.dim_int"),
    "amax": ref("aten.amax.default"),
    "amin": ref("aten.amin.default"),
    "max": ref("aten.max.default"),  # of the whole tensor; with a dim it is max_dim, with a tensor maximum
    "min": ref("aten.min.default"),
    "max_dim": ref("aten.max.dim"),
    "min_dim": ref("aten.min.dim"),
    "argmax": ref("aten.argmax.default"),
    "argmin": ref("aten.argmin.default"),
    "all": ref("aten.all.dim", defaults={"dim": None}),
    "any": ref("aten.any.dim", defaults={"dim": None}),
    "var": ref("aten.var.correction"),
    "std": ref("aten.std.correction"),
    "var_mean": ref("aten.var_mean.correction"),
    "std_mean": ref("aten.std_mean.correction"),
    "norm": ref("aten.norm.ScalarOpt_dim", renames={"ord": "p"}),
    "logsumexp": ref("aten.logsumexp.default"),
    "cumsum": ref("aten.cumsum.default"),
    "cumprod": ref("aten.cumprod.default"),
    **{f"max_pool{d}d": ref(f"aten.max_pool{d}d.default") for d in (1, 2, 3)},
    **{f"max_pool{d}d_with_indices": ref(f"aten.max_pool{d}d_with_indices.default") for d in (2, 3)},
    **{f"avg_pool{d}d": ref(f"aten.avg_pool{d}d.default") for d in (1, 2, 3)},
    **{f"adaptive_avg_pool{d}d": ref(f"aten.adaptive_avg_pool{d}d.default") for d in (1, 2, 3)},
}

NORMALIZATIONS = {
    "softmax": ref("aten.softmax.int"),
    "log_softmax": ref("aten.log_softmax.int"),
    "layer_norm": ref("aten.layer_norm.default"),
    "native_layer_norm": ref("aten.native_layer_norm.default"),
    "rms_norm": ref("aten.rms_norm.default"),
    "group_norm": ref("aten.group_norm.default"),
    "native_group_norm": ref("aten.native_group_norm.default"),
    "instance_norm": ref("aten.instance_norm.default"),
    "normalize": explicit("x", {"p": 2.0, "dim": 1, "eps": 1e-12}),
    # In training mode with running stats, batch norm writes them in place; *_train are those calls.
    "batch_norm": ref("aten.batch_norm.default", batch_stats=True),
    "batch_norm_train": ref("aten.batch_norm.default", mutates=True, batch_stats=True),
    "native_batch_norm": ref("aten.native_batch_norm.default", batch_stats=True),
    "native_batch_norm_train": ref("aten.native_batch_norm.default", mutates=True, batch_stats=True),
}

MATMULS = {
    "matmul": ref("aten.matmul.default"),
    "mm": ref("aten.mm.default", blas=True),
    "bmm": ref("aten.bmm.default", blas=True),
    "mv": ref("aten.mv.default", blas=True),
    "dot": ref("aten.dot.default", blas=True),
    "outer": ref("aten.outer.default"),
    "addmm": ref("aten.addmm.default", blas=True),
    "addmv": ref("aten.addmv.default", blas=True),
    "baddbmm": ref("aten.baddbmm.default", blas=True),
    "addbmm": ref("aten.addbmm.default", blas=True),
    "linear": ref("aten.linear.default"),
    "einsum": ref("aten.einsum.default", renames={"operands": "tensors"}),
    "tensordot": ref("aten.tensordot.default"),
    # mixture-of-experts experts: each group of rows (offs) times its own matrix
    "grouped_mm": ref("aten._grouped_mm.default"),
    **{f"conv{d}d": ref(f"aten.conv{d}d.default") for d in (1, 2, 3)},
    "conv_transpose1d": ref("aten.conv_transpose1d.default"),
    **{f"conv_transpose{d}d": ref(f"aten.conv_transpose{d}d.input") for d in (2, 3)},
    "convolution": ref("aten.convolution.default"),
    "scaled_dot_product_attention": ref("aten.scaled_dot_product_attention.default"),
    "scaled_dot_product_attention_dropout": ref("aten.scaled_dot_product_attention.default", random=True),
    # the fused kernels sdpa lowers to; they also return logsumexp etc.
    "scaled_dot_product_attention_kernel": ref("aten._scaled_dot_product_flash_attention_for_cpu.default"),
}

LOSSES = {
    "cross_entropy": ref("aten.cross_entropy_loss.default"),
    "nll_loss": ref("aten.nll_loss.default"),
    "mse_loss": ref("aten.mse_loss.default"),
    "l1_loss": ref("aten.l1_loss.default"),
    "smooth_l1_loss": ref("aten.smooth_l1_loss.default"),
    "huber_loss": ref("aten.huber_loss.default"),
    "binary_cross_entropy": ref("aten.binary_cross_entropy.default"),
    "binary_cross_entropy_with_logits": ref("aten.binary_cross_entropy_with_logits.default"),
    "kl_div": ref("aten.kl_div.default"),
}

BY_KIND = {"reduction": REDUCTIONS, "normalization": NORMALIZATIONS, "matmul": MATMULS, "loss": LOSSES}
SPECS = {name: dict(spec, kind=kind) for kind, table in BY_KIND.items() for name, spec in table.items()}
