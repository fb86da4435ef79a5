"""View ops: results that alias their input's storage (or may, like reshape and contiguous)."""
from .schema import explicit, ref

SPECS = {
    "view": ref("aten.view.default"),
    "reshape": ref("aten.reshape.default"),
    "view_as": ref("aten.view_as.default"),
    "reshape_as": ref("aten.reshape_as.default"),
    "flatten": ref("aten.flatten.using_ints"),
    "unflatten": ref("aten.unflatten.int"),
    "unsqueeze": ref("aten.unsqueeze.default"),
    "squeeze": ref("aten.squeeze.dims", defaults={"dim": None}),
    "permute": ref("aten.permute.default"),
    "transpose": ref("aten.transpose.int", renames={"axis0": "dim0", "axis1": "dim1"}),
    "t": ref("aten.t.default"),
    "numpy_T": ref("aten.numpy_T.default"),  # x.T: every dim reversed
    "movedim": ref("aten.movedim.int"),
    "expand": ref("aten.expand.default"),
    "expand_as": ref("aten.expand_as.default"),
    "slice": ref("aten.slice.Tensor"),
    "select": ref("aten.select.int"),
    "narrow": ref("aten.narrow.default"),
    "split": ref("aten.split.Tensor", renames={"split_sizes": "split_size", "split_size_or_sections": "split_size"}),
    "chunk": ref("aten.chunk.default"),
    "unbind": ref("aten.unbind.int"),
    "unfold": ref("aten.unfold.default"),
    "diagonal": ref("aten.diagonal.default"),
    "as_strided": ref("aten.as_strided.default"),
    "alias": ref("aten.alias.default"),
    "detach": ref("aten.detach.default"),
    "contiguous": ref("aten.contiguous.default"),
    # x[basic index]: ints, slices, None, Ellipsis. Tensor indices make it getitem_index (a gather).
    "getitem": explicit("x", {"index": None}),
    # element `index` of a multi-output op's result (split, native_layer_norm, max_dim, ...)
    "tuple_getitem": explicit("x", {"index": None}),
}
for spec in SPECS.values():
    spec.update(kind="view", aliases=True)
# the result is the input's elements in their order, read in a new shape
for name in ("view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "unsqueeze", "squeeze"):
    SPECS[name].update(keeps_order=True)
