"""Rewrite a graph so that each repeated block runs as a submodule of its own, unit_0 ...
unit_{K-1}, an FSDP unit: fully_shard on it gathers its parameters before its forward and frees
them after, which needs a module that holds them and whose forward is the block's.

1. Each block's nodes, the contiguous run from its first node to its last in graph order (a
   recompute segment belongs to the blocks its nodes ran in), become unit_k; runs that overlap
   become one unit (the recompute pass keeps its segments within blocks when the shard pass
   follows it). Nodes outside every block (embeddings, the final norm, the head) stay in the root
   graph, whose own fully_shard holds their parameters.
2. The GraphModule of each recompute segment a unit (or the root) calls is registered on it as
   segment_k: a segment is held by a callable, and fully_shard replaces the parameters of the
   modules it finds under the unit, so the segment's modules must be found there too, or the
   segment would read parameters FSDP does not hold.
3. A parameter read in one unit only is read inside it; one read by several (a tied embedding
   and head, one in a block) is read by the root and given to each unit that reads it as an
   input, so that exactly one FSDP unit (the root) holds it. A parameter that two units reach
   through a module they both call (a layer shared by every block) cannot be held by one: the
   rewrite refuses it.
4. The root then holds only what its graph calls and reads, in containers of its own: the model's
   modules are the graph's (trace.py shares them), and what the units took stays in the model.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ...analysis.blocks import outer_blocks
from ...analysis.segments import SegmentCall, segment_parameters
from ...errors import UsageError
from ..submodule import stage_module


def block_runs(nodes: list[torch.fx.Node], blocks: dict[str, list[int]]) -> list[tuple[int, int, list[str]]]:
    """Step 1: (start, stop, block paths) of each unit, in graph order, overlapping runs merged."""
    runs = sorted((min(at), max(at) + 1, [path]) for path, at in blocks.items())
    merged: list[tuple[int, int, list[str]]] = []
    for start, stop, paths in runs:
        if merged and start < merged[-1][1]:
            first, last, before = merged[-1]
            merged[-1] = (first, max(last, stop), before + paths)
        else:
            merged.append((start, stop, paths))
    return merged


def split_units(gm: torch.fx.GraphModule, runs: list[tuple[int, int, list[str]]]) -> dict[str, list[str]]:
    """Steps 1 to 4: unit_k for each run; the parameters read by the root and given to units
    (by attribute name -> the units that read them)."""
    nodes = list(gm.graph.nodes)
    owner: dict[torch.fx.Node, int] = {}
    for k, (start, stop, _) in enumerate(runs):
        for n in nodes[start:stop]:
            if n.op not in ("get_attr", "placeholder", "output"):
                owner[n] = k
    readers: dict[str, set] = {}
    for n in nodes:
        if n.op == "get_attr":
            readers.setdefault(n.target, set()).update(owner.get(u) for u in n.users)
    shared = {target for target, who in readers.items() if len(who) > 1}
    _refuse_shared_modules(gm, nodes, owner, shared)
    for k in range(len(runs)):
        body = [n for n in nodes if owner.get(n) == k]
        _extract(gm, body, f"unit_{k}", shared)
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and not n.users:
            gm.graph.erase_node(n)
    gm.graph.lint()
    _hold_what_the_root_uses(gm)
    for module in (gm, *(getattr(gm, f"unit_{k}") for k in range(len(runs)))):
        for n in module.graph.nodes:
            if isinstance(n.target, SegmentCall):
                module.add_submodule(f"segment_{n.target.index}", n.target.module)
    gm.recompile()
    return {target: [f"unit_{k}" for k in sorted(k for k in readers[target] if k is not None)] for target in sorted(shared)}


def _hold_what_the_root_uses(gm: torch.fx.GraphModule) -> None:
    """Step 4: the root holds the modules its graph calls and the attributes it reads, each at its
    path in containers of its own, and nothing else, as fx builds a GraphModule: fully_shard on the
    root manages every parameter under it that no unit holds, so a parameter left there and read in a
    unit would be managed twice (a block's Linear whose weight a unit reads and whose bias a fused
    kernel in the root adds). The traced graph held the model's own modules (trace._share_structure):
    the model keeps them."""
    before = torch.nn.Module()
    for name, child in list(gm.named_children()):
        if not name.startswith("unit_"):
            before.add_module(name, child)
            delattr(gm, name)
    direct = {**gm._parameters, **gm._buffers}
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module" and not n.target.startswith("unit_")]
    read = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    for name in direct:
        if name not in read:  # the model's own tensor, read in a unit only
            delattr(gm, name)
    for target in [*targets, *(t for t in read if t not in direct)]:
        _install(before, gm, target)


def _install(source: torch.nn.Module, root: torch.nn.Module, target: str) -> None:
    """source's attribute at `target` (a module, parameter or tensor) at the same path in root,
    in fresh containers where root has none yet."""
    *path, field = target.split(".")
    for part in path:
        source = getattr(source, part)
        held = root._modules.get(part)
        if held is source:  # the whole module is there already
            return
        if held is None:
            held = torch.nn.Module()
            root.add_module(part, held)
        root = held
    value = getattr(source, field)
    if isinstance(value, torch.nn.Module):
        root.add_module(field, value)
    elif isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        root.register_buffer(field, value, persistent=field not in source._non_persistent_buffers_set)
    else:
        setattr(root, field, value)


def _extract(gm: torch.fx.GraphModule, body: list[torch.fx.Node], name: str, shared: set[str]) -> None:
    """Replace body (contiguous in graph order but for attribute reads) by a call of a submodule
    running it."""
    inside = set(body)
    inputs = list(dict.fromkeys(i for n in body for i in n.all_input_nodes
                                if i not in inside and (i.op != "get_attr" or i.target in shared)))
    outputs = [n for n in body if any(u not in inside for u in n.users)]
    gm.add_submodule(name, stage_module(gm, inputs, body, outputs, class_name="Unit"))
    with gm.graph.inserting_after(body[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    for k, value in enumerate(outputs):
        with gm.graph.inserting_after(call if k == 0 else item):
            item = gm.graph.call_function(operator.getitem, (call, k))
        item.meta = dict(value.meta)
        value.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
    for n in reversed(body):
        gm.graph.erase_node(n)


def _refuse_shared_modules(gm, nodes, owner, shared: set[str]) -> None:
    """A parameter reached by two owners (units, or a unit and the root) other than through a
    shared attribute read: fully_shard would hold it in each."""
    where: dict[int, tuple[str, set]] = {}
    for n in nodes:
        if isinstance(n.target, SegmentCall):
            params, who = segment_parameters(n.target), owner.get(n, "root")
        elif n.op == "call_module":
            params, who = list(gm.get_submodule(n.target).parameters()), owner.get(n, "root")
        elif n.op == "get_attr" and n.users:  # one a segment reads itself is left without users
            value = _attribute(gm, n.target)
            params = [value] if isinstance(value, torch.nn.Parameter) else []
            # a shared one is the root's; another is read where its one reader runs
            who = "root" if n.target in shared else owner.get(next(iter(n.users), n), "root")
        else:
            continue
        for p in params:
            where.setdefault(id(p), (n.target, set()))[1].add(who)
    for name, owners in where.values():
        if len(owners) > 1:
            who = ", ".join(f"unit_{o}" if o != "root" else "the root" for o in sorted(owners, key=str))
            raise UsageError(f"shard='fsdp': a parameter of {name} is read by {who} through a module they all "
                             f"call (weights shared between blocks), and an FSDP unit must hold each parameter "
                             f"alone: untie them, or leave shard out.")


def _attribute(gm: torch.nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def make_units(gm: torch.fx.GraphModule) -> tuple[list[tuple[int, int, list[str]]], dict[str, list[str]]]:
    """The whole rewrite of gm, its blocks those outer_blocks finds: each unit's run of nodes, and
    the parameters passed to units (split_units)."""
    nodes = list(gm.graph.nodes)
    runs = block_runs(nodes, outer_blocks(nodes))
    return runs, split_units(gm, runs)
