"""Ops that make new tensors from shapes and scalars, deterministic (creation) or drawn from the RNG
(random: never CSE'd, never removed as dead, since either would shift every later random draw)."""
from .schema import explicit, ref

CREATION = {
    "arange": ref("aten.arange.start_step", defaults={"start": 0}),
    "linspace": ref("aten.linspace.default"),
    "eye": ref("aten.eye.default"),
    "zeros": ref("aten.zeros.default"),
    "ones": ref("aten.ones.default"),
    "empty": ref("aten.empty.memory_format"),
    "full": ref("aten.full.default"),
    "zeros_like": ref("aten.zeros_like.default"),
    "ones_like": ref("aten.ones_like.default"),
    "empty_like": ref("aten.empty_like.default"),
    "full_like": ref("aten.full_like.default"),
    "new_zeros": ref("aten.new_zeros.default"),
    "new_ones": ref("aten.new_ones.default"),
    "new_empty": ref("aten.new_empty.default"),
    "new_full": ref("aten.new_full.default"),
    "scalar_tensor": ref("aten.scalar_tensor.default"),
    "tensor": explicit("", {"data": None, "dtype": None, "device": None, "requires_grad": False, "pin_memory": False}),
    "fill": ref("aten.fill.Scalar"),
    "zero": ref("aten.zero.default"),
}

RANDOM = {
    "dropout": ref("aten.dropout.default", renames={"training": "train"}),
    "native_dropout": ref("aten.native_dropout.default", renames={"training": "train"}),
    "feature_dropout": ref("aten.feature_dropout.default", renames={"training": "train"}),
    "alpha_dropout": ref("aten.alpha_dropout.default", renames={"training": "train"}),
    "feature_alpha_dropout": ref("aten.feature_alpha_dropout.default", renames={"training": "train"}),
    "bernoulli": ref("aten.bernoulli.p", defaults={"p": None}),
    "multinomial": ref("aten.multinomial.default"),
    "normal": ref("aten.normal.float_float", defaults={"mean": 0.0, "std": 1.0}),
    "uniform": ref("aten.uniform.default"),
    "rand": ref("aten.rand.default"),
    "randn": ref("aten.randn.default"),
    "randint": ref("aten.randint.low", defaults={"low": 0}),
    "randperm": ref("aten.randperm.default"),
    "rand_like": ref("aten.rand_like.default"),
    "randn_like": ref("aten.randn_like.default"),
    "randint_like": ref("aten.randint_like.default"),
}

SPECS = {**{n: dict(s, kind="creation") for n, s in CREATION.items()},
         **{n: dict(s, kind="random", random=True) for n, s in RANDOM.items()}}
