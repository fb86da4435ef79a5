"""fuse: run each group of elementwise ops, with the norms, softmaxes and row reductions among
them, as one generated Triton kernel, forward and backward.

Algorithm:
  0. Candidates joined by reshapes compute in one shape (views.py: the graph is rewritten
     so, at the example's sizes, and marked specialized to them). Not under fuse{views=false},
     nor in the default pipeline, whose graph runs at any shape, unless fuse{views=true} says
     so; not for a graph staged over microbatches, which runs at a microbatch's sizes, nor
     where no kernel runs (step 1).
  1. Find the groups (fusion.py: maximal connected groups of registry elementwise
     ops and reductions over the last dim that keep the graph acyclic and that codegen accepts)
     and why their neighbours stay out. Kernels run on CUDA, or in Triton's interpreter (how
     the tests check them on CPU); on another device a group would run as torch ops, slower than
     eager's and keeping more memory, so the pass looks for none and reports that reason. On CUDA
     a group whose call would be slower than its eager ops at these sizes, host time included,
     stays eager (profit.py step 3; the report counts them: left_eager).
  2. Place each group: its node must come after every input and before every outside use of an
     output. Members are removed, so that is the spot after the last member, or else just before
     the first outside use; when an input is only computed after that use, the group is left
     alone with that reason (fusing it would need the graph reordered); an attribute read moves
     up to the call. No node that may write what a group reads or makes lies between its members
     (fusion.py step 2), so no read moves past a write to it.
  3. Insert one call_function node targeting a FusedOp (runtime/fused.py) or a FusedRowOp
     (runtime/fused_row.py), reading a leaf module's parameters through get_attr nodes (a
     matmul whose bias the group adds is inserted where it was, without its bias), plus an
     operator.getitem node per output when there are several; copy the members' metadata onto
     them; point every outside use at them (an identity dropout's uses at what it returns) and
     erase the members.
  4. Report each group (ops, nodes, bytes of forward memory traffic saved, neighbours left out
     and why), each declined group and each elementwise op left alone (with its neighbours'
     reasons) as stats; note the decisions on the nodes; hand the kernels' sources, a repro
     script per elementwise group and a readable fusion report to the dumps.
  5. A cross-entropy group over a linear head's logits runs with the head over chunks of rows
     (head_loss.py): no logits of the whole batch, nor their gradient, where the graph
     does not use them otherwise.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import operator
from dataclasses import dataclass

import torch.fx

from ... import ops
from ...analysis.cost import rates
from ...analysis.dispatched import DISPATCHED, Dispatched
from ...analysis.effects import written_values
from ...analysis.memory import estimate_peak
from ...analysis.meta import KEY, TensorInfo, gather, graph_device, tensor_info
from ...codegen.row_group import RowGroup
from ...codegen.row_kernel import source as row_source
from ...codegen.row_launch import layout as row_layout
from ...codegen.row_program import backward_program, forward_program
from ...frontend.trace import annotate
from ...runtime import FusedOp, repro_script, source
from ...runtime.fused import interpreting
from ...runtime.fused_row import FusedRowOp
from ..base import Pass, PassContext, PassResult, option, to_bool
from ..notes import note
from ..registry import register
from .dropout_members import DrawnMask
from .epilogue_members import CONV_PARAMS, WITHOUT_BIAS, BiasFree
from .fusion import FusionGroup, candidates, find_groups, memory_bound, traffic
from .group_outputs import absorbed_checks, outside_users
from .head_loss import chunk_heads
from .profit import slower_than_eager
from .row_members import StateInput, as_state, info_of
from .views import lift_views


def _outside_users(group: FusionGroup) -> list[torch.fx.Node]:
    inside = set(group.nodes)
    return [u for n in group.outputs + [a for a, t in group.aliases.items() if t not in group.inputs]
            for u in outside_users(n, inside)]


def _anchor(group: FusionGroup) -> tuple[torch.fx.Node | None, str | None]:
    """Step 2: the node to insert the fused call before, or the reason there is none. fx nodes
    compare in graph order (their sort keys, kept as nodes are inserted): no position table is
    rebuilt per group."""
    first_use = min(_outside_users(group))
    # an attribute read placed later moves up to the fused call (_rewrite): it reads no value
    given = [v.shape_of if isinstance(v, DrawnMask) else v for v in group.inputs]
    last_input = max((n for n in given if isinstance(n, torch.fx.Node) and n.op != "get_attr"), default=None)
    if last_input is not None and last_input > first_use:
        return None, (f"{first_use.name} uses the group's result before its input {last_input.name} is "
                      "computed; fusing would need the graph reordered")
    after_last = group.nodes[-1].next
    return (after_last if after_last <= first_use else first_use), None


def _replaced(value, replaced: dict):
    """A group's input, where a group fused before made it: the node that now gives its value."""
    if isinstance(value, DrawnMask) and value.shape_of is not None:
        return dataclasses.replace(value, shape_of=replaced.get(value.shape_of, value.shape_of))
    return replaced.get(value, value)


def _rewrite(gm: torch.fx.GraphModule, group: FusionGroup, anchor: torch.fx.Node, label: str, replaced: dict):
    """Step 3 for one group: returns the fused call node; records what replaced each member in `replaced`."""
    graph = gm.graph
    # a mask is no graph value: the call draws it (runtime/dropout_masks.py), a dropout's at the
    # group's shape, a bernoulli's at the shape of the bernoulli's input, which the call is given
    draws = tuple(v.draw(k) for k, v in enumerate(group.inputs) if isinstance(v, DrawnMask))
    taken = [_without_bias(gm, v) if isinstance(v, BiasFree) else v.shape_of if isinstance(v, DrawnMask) else v
             for v in group.inputs if not (isinstance(v, DrawnMask) and v.shape_of is None)]
    with graph.inserting_before(anchor):
        inputs = [graph.get_attr(v.target) if isinstance(v, StateInput) else v for v in taken]
        for v in inputs:
            if v.op == "get_attr" and v > anchor:
                anchor.prepend(v)
        for node, v in zip(inputs, taken):
            if isinstance(v, StateInput):
                node.meta[KEY] = v.info
        # the call checks its inputs' dtypes and devices where it binds, which settles the checks
        # of the values it computes (group_outputs.absorbed_checks): they go with its nodes
        kinds = tuple(_kind(v) for v in inputs)
        runs = FusedRowOp(group.group, group.finish, group.orders, group.rows.col_dims, group.updates, draws, kinds) \
            if isinstance(group.group, RowGroup) else FusedOp(group.group, draws, kinds)
        call = graph.call_function(runs, tuple(inputs))
        call.meta[DISPATCHED] = _effects(group, draws)
        gather(call, group.outputs, single=len(group.outputs) == 1)
        note(call, "fuse", label)
        results = [call]
        if len(group.outputs) > 1:
            results = [graph.call_function(operator.getitem, (call, i)) for i in range(len(group.outputs))]
            for i, (result, node) in enumerate(zip(results, group.outputs)):
                gather(result, [node], single=True)
                note(result, "fuse", f"{label} output {i}")
    for check in absorbed_checks(group.nodes):
        graph.erase_node(check)
    for result, node in zip(results, group.outputs):
        node.replace_all_uses_with(result)
        replaced[node] = result
    for alias, target in group.aliases.items():
        replaced[alias] = results[group.outputs.index(target)] if target in group.outputs else target
        alias.replace_all_uses_with(replaced[alias])
    for node in reversed(group.nodes):
        graph.erase_node(node)
    return call


def _kind(node: torch.fx.Node) -> tuple | None:
    """An input's traced dtype and device type, which the fused call takes alone; None where unknown."""
    info = tensor_info(node)
    return (info.dtype, info.device.type) if isinstance(info, TensorInfo) else None


def _effects(group: FusionGroup, draws: tuple) -> Dispatched:
    """What the fused call does besides its result, as annotation records it of a call the registry
    does not list (analysis/dispatched.py): its kernels only compute, unless it draws dropout masks or
    updates a batch norm's running statistics. Recompute, cse and dce read it as of any such call."""
    return Dispatched(tuple(str(n.target) for n in group.nodes),
                      writes="its batch norms' running statistics, updated in place" if group.updates else None,
                      draws="aten.bernoulli_ (the dropout masks it draws)" if draws else None)


def _without_bias(gm: torch.fx.GraphModule, value: BiasFree) -> torch.fx.Node:
    """A node computing the linear or convolution without its bias, where it was: its group adds
    the bias (epilogue_members.py)."""
    bound = ops.bind(value.node, gm)
    weight = as_state(bound.operands[1], gm)
    extra = () if value.op == "linear" else tuple(bound.params[p] for p in CONV_PARAMS)
    with gm.graph.inserting_before(value.node):
        if isinstance(weight, StateInput):
            state, weight = weight, gm.graph.get_attr(weight.target)
            weight.meta[KEY] = state.info
        node = gm.graph.call_function(WITHOUT_BIAS[value.op], (bound.operands[0], weight, None, *extra))
    gather(node, [value.node], single=True)
    note(node, "fuse", "its bias is added by the group after it")
    return node


def _kernel_files(name: str, group: FusionGroup) -> dict[str, str]:
    infos = [info_of(n) for n in group.inputs]
    inputs = ", ".join(f"{n.name} {i.short()}" for n, i in zip(group.inputs, infos))
    header = (f"# {name}: {group.group.describe()}\n# FX nodes: {', '.join(n.name for n in group.nodes)}\n"
              f"# inputs: {inputs}\n# outputs: {', '.join(n.name for n in group.outputs)}\n\n")
    if isinstance(group.group, RowGroup):
        given = iter(infos)  # the graph's values; the column index is the kernel's own
        row_infos = [None if group.group.is_index(k) else next(given) for k in range(len(group.group.inputs))]
        looped = row_layout(group.rows.columns)[0]
        needs = [i is not None and i.dtype.is_floating_point for i in row_infos]
        program = backward_program(group.group, [True] * len(group.group.outputs), needs)
        forward = row_source(group.group, forward_program(group.group), "row_forward", looped)
        backward = row_source(group.group, program, "row_backward", looped) if program.grads else None
        return {f"kernels/{name}.py": header + forward + ("\n\n" + backward if backward else "")}
    shapes, dtypes = [i.shape for i in infos], [i.dtype for i in infos]
    forward, backward = source(group.group, shapes, dtypes, [i.stride for i in infos])
    return {f"kernels/{name}.py": header + forward + ("\n\n" + backward if backward else ""),
            f"kernels/{name}_repro.py": repro_script(group.group, shapes, dtypes)}


def _report(stats: dict) -> str:
    groups, declined, alone = stats["groups"], stats["declined"], stats["alone"]
    lines = ["# fusion report", "",
             f"{stats['memory_bound_ops_unfused']} of the forward's {stats['memory_bound_ops']} memory-bound ops "
             f"left outside kernels; their traffic {stats['memory_bound_traffic_before']} -> "
             f"{stats['memory_bound_traffic_after']} bytes", ""]
    for g in groups:
        lines.append(f"## {g['name']}: {' -> '.join(g['ops'])}")
        lines.append(f"nodes: {', '.join(g['nodes'])}; reads {g['bytes_read']}, writes {g['bytes_written']} bytes; "
                     f"saves {g['bytes_saved']} bytes of forward traffic")
        if g["checks_settled"]:
            lines.append(f"dtype checks of its values dropped (its call checks its inputs' dtypes and devices): "
                         f"{', '.join(g['checks_settled'])}")
        lines += [f"- {n} not fused: {r}" for n, r in g["not_fused"].items()]
        lines.append("")
    for r in stats.get("view_regions", ()):
        lines.append(f"## computed in one shape {r['shape']} across reshapes: {', '.join(r['nodes'])}\n")
    for d in declined:
        lines.append(f"## declined: {', '.join(d['nodes'])}\n{d['reason']}\n")
    for d in stats.get("slower_than_eager", ()):
        lines.append(f"## slower than eager: {', '.join(d['nodes'])}\n{d['reason']}\n")
    for h in stats.get("chunked_heads", ()):
        also = ", which also returns the logits" if h["returns_logits"] else ""
        lines.append(f"## {h['name']}: the linear head {h['head']} and the loss {h['loss']} over chunks of rows{also}\n")
    for name, why in stats.get("heads_not_chunked", {}).items():
        lines.append(f"## loss {name} not chunked with a head: {why}\n")
    for name, reasons in alone.items():
        lines.append(f"## alone: {name}")
        lines += [f"- {n} not fused: {r}" for n, r in reasons.items()]
        lines.append("")
    return "\n".join(lines)


NO_TRITON = ("Triton is not installed: the fused kernels are Triton's (torch's Linux CUDA builds bring it; "
             "elsewhere pip install triton)")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class FuseOptions:
    """The fuse pass's options."""

    views: bool | None = option(None, to_bool, "compute candidates joined by reshapes in one shape, which "
                                "specializes the graph to the example's sizes (default: when fuse is asked for, not "
                                "in the default pipeline, whose graph runs at any shape)")


@register
class Fuse(Pass):
    """Fuse groups of elementwise ops, norms and softmaxes into generated Triton kernels."""

    name = "fuse"
    runs_after = {"precision": "a group computes in the dtypes its ops have when it is fused: fused before the precision "
                               "pass, it would keep float32 where torch.autocast computes in bf16 or fp16"}
    Options = FuseOptions

    def skip_by_default(self, gm, ctx, pipeline):
        device = graph_device(gm)
        if device != "cuda":
            return (f"generated kernels pay on CUDA; on {device} each group would run its reference path, "
                    "slower than eager's ops")
        return NO_TRITON if not triton_installed() else None

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        bound_before = [n for n in gm.graph.nodes if memory_bound(n, gm)]
        traffic_before = sum(sum(traffic(n)) for n in bound_before)
        device = graph_device(gm)
        if not triton_installed():
            return PassResult(gm, False, {"kernels": 0, "not_run": NO_TRITON, "memory_bound_ops": len(bound_before),
                                          "memory_bound_ops_unfused": len(bound_before),
                                          "memory_bound_traffic_before": traffic_before,
                                          "memory_bound_traffic_after": traffic_before})
        if device != "cuda" and not interpreting():  # no kernel runs here: no group is looked for
            return PassResult(gm, False, {
                "kernels": 0, "not_run": f"fused kernels run on CUDA (or in Triton's interpreter); on {device} a "
                                         "group would run as torch ops, slower than eager's and keeping more memory: "
                                         "eager's ops stay",
                "memory_bound_ops": len(bound_before), "memory_bound_ops_unfused": len(bound_before),
                "memory_bound_traffic_before": traffic_before, "memory_bound_traffic_after": traffic_before})
        # Step 0
        regions = []
        # a staged graph runs at a microbatch's sizes, not the example's; where no kernel runs, no group forms
        views = not self.by_default if self.settings.views is None else self.settings.views
        if views and not ctx.microbatches:
            written = written_values(gm)
            regions = lift_views(gm, candidates(gm, written)[0], written)
        if regions:
            annotate(gm, ctx.flat_inputs(gm))
        # Step 1
        fusion = find_groups(gm)
        declined, slower = list(fusion.declined), []
        done, files = [], {}
        replaced: dict = {}  # a member of a group already fused -> the node that now gives its value
        for found in fusion.groups:
            why = slower_than_eager(found, rates(device), ctx.train) if device == "cuda" else None
            if why is not None:  # where kernels run for speed; the interpreter's are there to be checked
                slower.append({"nodes": [n.name for n in found.nodes], "ops": found.ops(), "reason": why})
                continue
            # an input (or an alias's target) a group fused earlier computed now comes from its node
            group = dataclasses.replace(found, inputs=[_replaced(v, replaced) for v in found.inputs],
                                        aliases={a: replaced.get(t, t) for a, t in found.aliases.items()})
            # Step 2
            anchor, reason = _anchor(group)
            if anchor is None:
                declined.append({"nodes": [n.name for n in group.nodes], "ops": group.ops(), "reason": reason})
                continue
            # Step 3
            nodes = [n.name for n in group.nodes]
            settled = [c.name for c in absorbed_checks(group.nodes)]
            call = _rewrite(gm, group, anchor, f"group {len(done)}", replaced)
            # Step 4
            read, written = traffic(call)
            done.append({"name": call.name, "ops": group.ops(), "nodes": nodes, "rows": isinstance(group.group, RowGroup),
                         "inputs": [n.name for n in group.inputs], "outputs": [n.name for n in group.outputs],
                         "bytes_saved": group.bytes_saved, "bytes_read": read, "bytes_written": written,
                         "checks_settled": settled, "not_fused": group.not_fused})
            files.update(_kernel_files(call.name, group))
        # Step 5
        heads, unchunked = chunk_heads(gm, lambda module: estimate_peak(module, ctx.flat_inputs(module),
                                                                        train=ctx.train).peak_bytes)
        by_name = {n.name: n for n in gm.graph.nodes}
        for group in slower:
            for name in group["nodes"]:
                note(by_name[name], "fuse", f"not fused: {group['reason']}")
        for reasons in [g["not_fused"] for g in done] + list(fusion.alone.values()):
            for name, reason in reasons.items():
                if name in by_name:
                    note(by_name[name], "fuse", f"not fused: {reason}")
        bound_after = [n for n in gm.graph.nodes if memory_bound(n, gm)]
        stats = {"kernels": len(done), "fused_nodes": sum(len(g["nodes"]) for g in done),
                 "bytes_saved": sum(g["bytes_saved"] for g in done),
                 # the forward's memory-bound ops, and the bytes they move, before and after
                 "memory_bound_ops": len(bound_before), "memory_bound_ops_unfused": len(bound_after),
                 "memory_bound_traffic_before": traffic_before,
                 "memory_bound_traffic_after": sum(sum(traffic(n)) for n in bound_after)
                 + sum(g["bytes_read"] + g["bytes_written"] for g in done),
                 "groups": done, "declined": declined, "alone": fusion.alone,
                 "left_eager": len(slower), "slower_than_eager": slower,
                 "chunked_heads": heads, "heads_not_chunked": unchunked}
        stats["view_regions"] = [{"nodes": [n.name for n in r.nodes], "shape": list(r.shape)} for r in regions]
        if done or declined or slower or fusion.alone:
            files["fusion.md"] = _report(stats)
        specialized = "fused groups compute across reshapes at the example's sizes" if regions else None
        return PassResult(gm, bool(done) or bool(regions), stats, files=files, specialized=specialized)
