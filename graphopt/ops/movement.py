"""Ops that move or index data rather than compute it (joins, gathers and scatters, copies,
embedding lookups), and the rest that is neither arithmetic nor a view: shape queries, asserts
and higher-order ops (which the registry only names)."""
from .schema import explicit, ref

SIDE_EFFECT = dict(side_effect=True, output="none")  # kept by DCE though nothing uses them

SPECS = {
    "cat": ref("aten.cat.default", renames={"axis": "dim"}),
    "stack": ref("aten.stack.default", renames={"axis": "dim"}),
    "gather": ref("aten.gather.default"),
    "index_select": ref("aten.index_select.default"),
    "index": ref("aten.index.Tensor"),
    "getitem_index": explicit("x", {"index": None}),  # x[tensor or list index]: a gather, not a view
    "setitem": explicit("x", {"index": None, "value": None}, mutates=True, output="none"),  # x[index] = value
    "index_put": ref("aten.index_put.default"),
    "index_add": ref("aten.index_add.default"),
    "index_copy": ref("aten.index_copy.default"),
    "scatter": ref("aten.scatter.src", renames={"value": "src"}),
    "scatter_add": ref("aten.scatter_add.default"),
    "masked_scatter": ref("aten.masked_scatter.default"),
    "masked_select": ref("aten.masked_select.default"),
    "nonzero": ref("aten.nonzero.default"),
    "diff": ref("aten.diff.default"),
    "triu": ref("aten.triu.default"),
    "tril": ref("aten.tril.default"),
    "repeat": ref("aten.repeat.default"),
    # with an int count (GPT-J's rotary tables); a tensor of counts makes a data-dependent size
    "repeat_interleave": ref("aten.repeat_interleave.self_int"),
    "tile": ref("aten.tile.default"),
    "flip": ref("aten.flip.default"),
    "roll": ref("aten.roll.default"),
    "pad": ref("aten.pad.default"),
    "one_hot": ref("aten.one_hot.default"),
    "sort": ref("aten.sort.default"),
    "argsort": ref("aten.argsort.default"),
    "topk": ref("aten.topk.default"),
    "histc": ref("aten.histc.default"),
    "bincount": ref("aten.bincount.default"),
    "interpolate": explicit("x", {"size": None, "scale_factor": None, "mode": "nearest", "align_corners": None,
                                  "recompute_scale_factor": None, "antialias": False}),
    "embedding": ref("aten.embedding.default", renames={"input": "indices"}),
    "clone": ref("aten.clone.default"),
    "copy": ref("aten.copy.default"),
    "to_device": explicit("x", {"device": None, "dtype": None}, aliases=True),
    "size": explicit("x", {"dim": None}, output="scalar"),
    "numel": explicit("x", output="scalar"),
    "dim": explicit("x", output="scalar"),
    "item": ref("aten._local_scalar_dense.default"),
    "assert_tensor_metadata": ref("aten._assert_tensor_metadata.default", **SIDE_EFFECT),
    "assert_async": ref("aten._assert_async.msg", **SIDE_EFFECT),
    "assert_scalar": ref("aten._assert_scalar.default", **SIDE_EFFECT),
    "assert": explicit("", {"condition": None, "message": None}, **SIDE_EFFECT),
    "sym_constrain_range": ref("aten.sym_constrain_range.default", **SIDE_EFFECT),
    "sym_constrain_range_for_size": ref("aten.sym_constrain_range_for_size.default", **SIDE_EFFECT),
    "set_grad_enabled": explicit("", {"mode": None}, **SIDE_EFFECT),
    "enter_autocast": explicit("", {}, side_effect=True),
    "exit_autocast": explicit("", {}, **SIDE_EFFECT),
    # higher-order ops run a nested graph; passes treat them as opaque calls returning a tuple
    "wrap_with_set_grad_enabled": explicit("", {}, output="tuple"),
    "wrap_with_autocast": explicit("", {}, output="tuple"),
}
for spec in SPECS.values():
    spec.setdefault("kind", "other")
