"""Attention masks that the graph builds from its inputs' sizes alone and that are causal: the
attention reads is_causal=True instead (normalize's step 7).

Why: transformers builds its causal mask in Python, and in eager passes none when the mask adds
nothing to causality (no padding, no packed sequences): SDPA then runs its causal kernel. That
test reads the inputs' values, so torch.export cannot take it, and an exported graph builds a
boolean [batch, 1, L, S] mask and hands it to every attention. Each SDPA converts it to an
additive float mask per call and saves that for backward (memory eager does not hold), and a
masked kernel cannot skip the blocks above the diagonal.

Soundness: the rewrite holds only where the mask is a function of sizes:
  1. Every node the mask depends on is a pure, deterministic op or Python arithmetic on sizes;
     the graph's inputs are read for their sizes only; no parameter, buffer or constant.
  2. Run on the example inputs, the mask is boolean, shaped (..., L, S) for the attention's
     L queries and S keys, and every (L, S) slice is SDPA's is_causal pattern, tril(ones(L, S)).
  3. A call at other sizes than those checked runs the masks' subgraph once for those sizes
     (CausalMaskCheck, a forward pre-hook optimize() installs) and raises a graphopt error if a
     mask is not causal there, before anything runs: the rewrite never holds silently wrong.
     A staged graph (the pipeline pass, microbatches) runs its stages where no such check
     sees them, so it keeps its masks.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .. import ops
from ..analysis import meta
from ..analysis.effects import pure_op, size_arithmetic
from ..runtime.causal_check import CausalMaskCheck, is_causal_mask
from .notes import note

ATTENTION = ("scaled_dot_product_attention", "scaled_dot_product_attention_dropout")
SIZE_READS = ("size", "numel", "dim")
METADATA = ("shape", "ndim", "dtype", "device")  # x.shape and the like, as fx traces them


def _reads_metadata(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """Whether node reads its input's sizes (or dtype, device), not its values."""
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in METADATA
    return op_name(node, gm) in SIZE_READS


def op_name(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str | None:
    """The registry's name for a call node's op; None for other nodes and unknown ops."""
    op = ops.lookup(node, gm) if node.op.startswith("call") else None
    return op.name if op is not None else None


def _sizes_only(mask: torch.fx.Node, gm: torch.fx.GraphModule) -> set | None:
    """Point 1: the nodes mask is computed by, when it is a function of the graph inputs' sizes
    alone; None otherwise."""
    seen, stack = set(), [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op in ("placeholder", "get_attr"):
            # its values are read (a size read does not go on to its input): an input's, or state's
            # (a parameter, buffer or constant) that may change between calls
            return None
        if not (size_arithmetic(node) or pure_op(node, gm) is not None):
            return None
        if _reads_metadata(node, gm):
            # A size is a function of the inputs' sizes unless an op upstream sized its result
            # by values (nonzero, masked_select: unbacked sizes).
            if any(free_unbacked_symbols(x.meta.get("val")) for x in node.all_input_nodes):
                return None
            continue
        stack.extend(node.all_input_nodes)
    return seen


def _queries_keys(bound) -> tuple | None:
    shapes = [getattr(meta.tensor_info(x), "shape", None) if isinstance(x, torch.fx.Node) else None
              for x in (bound["query"], bound["key"])]
    return None if None in shapes or len(shapes[0]) < 2 else (shapes[0][-2], shapes[1][-2])


def _without_mask(node: torch.fx.Node) -> None:
    """The attention call with attn_mask None and is_causal True, in whichever form it took them."""
    args, kwargs = list(node.args), dict(node.kwargs)
    for position, name, value in ((3, "attn_mask", None), (5, "is_causal", True)):
        if len(args) > position:
            args[position] = value
        else:
            kwargs[name] = value
    node.args, node.kwargs = tuple(args), kwargs


def _subgraph(gm: torch.fx.GraphModule, masks: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """A module taking gm's placeholders and returning the masks, computed by their ancestors
    alone (not fx's dead-code elimination: it keeps every assert, and what the assert reads)."""
    needed, stack = set(), list(masks)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    graph, copies = torch.fx.Graph(), {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in needed:
            copies[node] = graph.node_copy(node, lambda n: copies[n])
    graph.output(tuple(copies[m] for m in masks))
    return torch.fx.GraphModule(gm, graph)


def causal_masks(gm: torch.fx.GraphModule, ctx) -> tuple[int, CausalMaskCheck | None]:
    """Rewrite each attention whose mask is causal and made from sizes alone (points 1 and 2);
    the number rewritten, and the check for other sizes (point 3)."""
    if ctx.microbatches or ctx.staged:
        return 0, None  # stages run at microbatch sizes, through PipelineRunner: a check on calls of the whole would not see them
    found, subgraphs = {}, {}  # mask -> the attentions reading it, the nodes computing it
    for node in gm.graph.nodes:
        if op_name(node, gm) not in ATTENTION:
            continue
        bound = ops.bind(node, gm)
        if bound is None or bound.params.get("is_causal") or not isinstance(bound["attn_mask"], torch.fx.Node):
            continue
        sizes = _queries_keys(bound)
        info = meta.tensor_info(bound["attn_mask"])
        if sizes is None or info is None or info.dtype != torch.bool or tuple(info.shape[-2:]) != sizes:
            continue
        subgraph = _sizes_only(bound["attn_mask"], gm)
        if subgraph is not None:
            found.setdefault(bound["attn_mask"], []).append(node)
            subgraphs[bound["attn_mask"]] = subgraph
    if not found:
        return 0, None
    masks = list(found)
    with torch.no_grad():
        values = _subgraph(gm, masks)(*ctx.flat_inputs(gm))
    causal = [m for m, v in zip(masks, values) if is_causal_mask(v)]
    if not causal:
        return 0, None
    check = CausalMaskCheck(_subgraph(gm, causal), ctx.example_args, ctx.example_kwargs)
    for mask in causal:
        for attention in found[mask]:
            _without_mask(attention)
            note(attention, "normalize", f"{mask.name} is causal and made from the input sizes alone: is_causal=True")
    _erase_dead(gm, set().union(*(subgraphs[m] for m in causal)))
    gm.recompile()
    return sum(len(found[m]) for m in causal), check


def _erase_dead(gm: torch.fx.GraphModule, subgraph: set) -> None:
    """The nodes of the masks' subgraphs that nothing reads any more, users before their inputs."""
    for node in reversed(list(gm.graph.nodes)):
        if node in subgraph and not node.users and node.op == "call_function":
            gm.graph.erase_node(node)
