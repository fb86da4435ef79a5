"""Forward FLOP estimates from the shapes that tracing leaves in node.meta["val"].

Contractions count a multiply and an add per term (2*M*N*K); elementwise ops one per output element;
reductions and normalizations a few per input element; windowed pooling one per window element
of each output (a 3x3 max pool reads each input about nine times over). Views, creation, data movement, unknown ops
and nodes without shapes count 0.
"""
from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from .resolve import bind, lookup

SOFTMAX = 5  # max, subtract, exp, sum, divide
PER_INPUT_ELEMENT = {
    "softmax": SOFTMAX, "log_softmax": SOFTMAX, "logsumexp": 4, "layer_norm": 5, "native_layer_norm": 5,
    "rms_norm": 4, "group_norm": 5, "native_group_norm": 5, "batch_norm": 5, "batch_norm_train": 5,
    "native_batch_norm": 5, "native_batch_norm_train": 5, "instance_norm": 5, "normalize": 4,
    "var": 3, "std": 3, "var_mean": 3, "std_mean": 3, "norm": 2,
    "cross_entropy": SOFTMAX + 1, "nll_loss": 1, "mse_loss": 3, "l1_loss": 3, "smooth_l1_loss": 4, "huber_loss": 4,
    "binary_cross_entropy": 4, "binary_cross_entropy_with_logits": 6, "kl_div": 3,
}


def _val(v):
    """The (first) tensor a node or module attribute stands for, or None."""
    if isinstance(v, Node):
        v = v.meta.get("val")
    if isinstance(v, (list, tuple)):
        v = next((t for t in v if isinstance(t, torch.Tensor)), None)
    return v if isinstance(v, torch.Tensor) else None


def _numel(v) -> int:
    v = _val(v)
    try:
        return int(v.numel()) if v is not None else 0
    except (TypeError, RuntimeError):  # an unbacked symbolic size
        return 0


def _shape(v) -> tuple[int, ...]:
    v = _val(v)
    try:
        return tuple(int(s) for s in v.shape) if v is not None else ()
    except (TypeError, RuntimeError):
        return ()


def _last(v) -> int:
    s = _shape(v)
    return s[-1] if s else 0


def _attention(b, out):
    q, k, v = _shape(b["query"]), _shape(b["key"]), _shape(b["value"])
    if not (q and k and v):
        return 0
    scores = math.prod(q[:-1]) * k[-2]  # batch * heads * Lq * Lk
    return 2 * scores * q[-1] + 2 * scores * v[-1] + SOFTMAX * scores


def _conv(b, out, transposed=False):
    w = _shape(b["weight"])
    return 2 * (_numel(b["x"]) if transposed else out) * math.prod(w[1:]) if w else 0


def _einsum(b, out):
    equation, operands = b["equation"], b["tensors"]
    if not isinstance(equation, str) or not isinstance(operands, (list, tuple)) or "..." in equation:
        return 0
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    if len(inputs) != len(operands):
        return 0
    sizes = {c: n for spec, t in zip(inputs, operands) for c, n in zip(spec, _shape(t))}
    return 2 * math.prod(sizes.values())


def _tensordot(b, out):
    shape, dims = _shape(b["x"]), b["dims_self"]
    try:
        return 2 * out * math.prod(shape[d] for d in dims)
    except (TypeError, IndexError):  # dims missing or not matching the shape
        return 0


def _window(b, out):
    size = b["kernel_size"]
    size = [size] if isinstance(size, int) else list(size)
    spatial = len(_shape(b.operands[0])) - 2 if b.operands else len(size)
    if len(size) == 1:
        size = size * max(spatial, 1)
    return out * math.prod(size)


def _grouped_mm(b, out):
    """Each output element is one row of mat_a times one column of mat_b; with both 2-D (a weight
    gradient) the contraction runs along the groups' rows, so each group adds its own share."""
    a, mat2 = _shape(b["x"]), _shape(b["mat2"])
    if not a or not mat2:
        return 0
    groups = _shape(b["offs"])[0] if len(a) == len(mat2) == 2 and _shape(b["offs"]) else 1
    return 2 * out * a[-1] // max(groups, 1)


RULES = {
    "linear": lambda b, out: 2 * out * _last(b["x"]),
    "matmul": lambda b, out: 2 * out * _last(b["x"]),
    "mm": lambda b, out: 2 * out * _last(b["x"]),
    "bmm": lambda b, out: 2 * out * _last(b["x"]),
    "mv": lambda b, out: 2 * out * _last(b["x"]),
    "dot": lambda b, out: 2 * _numel(b["x"]),
    "outer": lambda b, out: out,
    "addmm": lambda b, out: 2 * out * _last(b["mat1"]),
    "addmv": lambda b, out: 2 * out * _last(b["mat"]),
    "baddbmm": lambda b, out: 2 * out * _last(b["batch1"]),
    "addbmm": lambda b, out: 2 * _numel(b["batch1"]) * _last(b["batch2"]),
    "tensordot": _tensordot,
    "grouped_mm": _grouped_mm,
    "einsum": _einsum,
    "conv1d": _conv, "conv2d": _conv, "conv3d": _conv,
    "conv_transpose1d": lambda b, out: _conv(b, out, True),
    "conv_transpose2d": lambda b, out: _conv(b, out, True),
    "conv_transpose3d": lambda b, out: _conv(b, out, True),
    "convolution": lambda b, out: _conv(b, out, bool(b["transposed"])),
    "scaled_dot_product_attention": _attention,
    "scaled_dot_product_attention_dropout": lambda b, out: _attention(b, out) + out,
    "scaled_dot_product_attention_kernel": _attention,
    **{f"{kind}_pool{d}d": _window for kind in ("max", "avg") for d in (1, 2, 3)},
    **{f"max_pool{d}d_with_indices": _window for d in (2, 3)},
}


def flops(node: Node, gm: GraphModule | None = None) -> int:
    op = lookup(node, gm)
    if op is None:
        return 0
    name, out = op.inplace_of or op.out_variant_of or op.name, _numel(node)
    if op.kind in ("elementwise", "random") and op.output == "tensor":
        return out
    if name in RULES or op.kind in ("reduction", "normalization") or name in PER_INPUT_ELEMENT:
        b = bind(node, gm)
        if b is None:
            return 0
        if name in RULES:
            return RULES[name](b, out)
        x = b.operands[0] if b.operands else None
        return _numel(x) * PER_INPUT_ELEMENT.get(name, 1 if op.kind == "reduction" else 5)
    return 0
