"""Which nodes can run as one fused kernel (an analysis: it reads the graph, never mutates).

Algorithm:
  1. Classify every call node. A member candidate is pure (analysis/effects.py), elementwise with a
     Triton template in the registry (or a dropout that is the identity: train=False or p=0; or
     a dropout in training of a contiguous float tensor, or a bernoulli of fixed probability (the
     noise of stochastic depth), whose mask the call draws: dropout_members.py; or a linear's or
     convolution's bias add, where moving it into the group after it pays: epilogue_members.py,
     profit.py),
     bound to tensor nodes and Python scalars, dense in eager (a float32 one eager lays out
     strided takes rows over its layout: a row group's kernels write it where eager does), and
     accepted by codegen as a one-step group at its operands' dtypes with eager's result dtype
     and shape; or a row member (row_members.py: a reduction, norm, softmax,
     cross-entropy, batch norm or rotary rotation over rows, in float32). Every other node gets
     the reason it stays out.
     A node computed from no input of the graph (a table the step rebuilds from arange: sinusoidal
     frequencies) stays eager: its kernel saves no traffic worth a launch, and eager's rounding
     of it is kept where a time step in the thousands multiplies it before a sin.
     An op that may return its input itself (a no-op cast, an identity dropout) stays out when a
     node that may write memory gets that tensor: the fused result is a copy.
  2. Walk the graph in order and merge each candidate's group with the groups of its candidate
     producers, row groups first (a bias add: its bias alone; its matmul, a vertex of its own
     before it, reads the others), unless (_Merging.can_merge, which returns a WhyNot) the
     contracted graph (networkx) would get a cycle (a path from one group to the other through a
     node outside both), or a node that may write what the group reads or makes would lie
     between the group's first and last node (the fused kernel reads all its inputs at one
     point; effects.written_inputs: a batch norm writes its running statistics only), or, when
     it holds a draw, another node that draws from the RNG would (the masks are drawn when the
     call runs: eager's order must hold), or the merged group would hold a row member and a value
     that is not a row, per-row or per-column value of its rows (row_fusion.fits_rows).
  3. Groups that do not pay are dropped (profit.py: fewer than two ops that compute, and no norm
     or softmax). Each remaining group becomes a codegen Group, or a RowGroup when it holds a
     row member: inputs are the outside tensors it reads (a leaf module's parameters too, for a
     row group), steps its nodes in graph order (an identity dropout is no step: it aliases its
     input; a row member the steps of its row program), outputs the nodes used outside it.
     codegen has the last word.
  4. For each group: the forward memory traffic it saves (eager reads and writes of every node
     minus the fused kernel's reads of inputs and writes of outputs, from TensorInfo.nbytes), and
     for each neighbouring node left out, the reason; the same reasons for each candidate left
     alone.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx

from ... import codegen, ops
from ...analysis.aliases import Aliases
from ...analysis.effects import CALLS, is_identity_dropout, may_draw, may_write, reads_attribute, state_effect, \
    written_inputs, written_values
from ...analysis.meta import TensorInfo, dense, leaves, tensor_info
from ...codegen.group import FLOATS
from ...codegen.row_group import RowGroup
from ...codegen.row_space import RowSpace
from .dropout_members import DrawnMask, drawn_bernoulli, emit_bernoulli, emit_dropout, training_dropout
from .epilogue_members import BiasFree, epilogue_member
from .group_outputs import group_outputs
from .profit import bias_add_pays, group_pays
from .row_fusion import build_rows, fits_rows
from .row_members import BATCH_NORMS, DTYPE, as_state, channel_layer_norm, channel_norm, info_of, \
    row_member
from .view_frames import reorder_free_view

CYCLE = "would create a cycle (path {path})"
NOT_ELEMENTWISE = "not elementwise ({kind})"
# ops bound by memory traffic rather than arithmetic: what fusion is for
MEMORY_BOUND = ("elementwise", "reduction", "normalization", "loss", "random")


@dataclass
class Member:
    """A node that may join a group: its op and its operands in canonical order."""

    node: torch.fx.Node
    op: str
    operands: tuple  # fx Nodes (tensors) and Python scalars
    params: dict
    identity: bool = False  # a dropout that returns its input
    row: RowSpace | None = None  # its rows: a row member's (row_members.py), or a strided elementwise node's layout
    strided: str | None = None  # why it may only be in a row group (which writes eager's layout)
    absorbed: tuple = ()  # nodes only it reads, computed inside its steps (a rotation's slices)
    mask: DrawnMask | None = None  # a dropout in training or a bernoulli: the mask the call draws (dropout_members.py)
    epilogue: str | None = None  # a linear's or convolution's bias add: the bias's class, COL or ROW (epilogue_members.py)


@dataclass
class FusionGroup:
    nodes: list[torch.fx.Node]  # graph order
    inputs: list  # fx Nodes, and for a row group StateInputs (a leaf module's parameters)
    outputs: list[torch.fx.Node]  # the step each one is stored from: group.outputs, same order
    aliases: dict  # identity member -> the input node it returns (it needs no kernel output)
    group: codegen.Group | RowGroup
    bytes_saved: int
    not_fused: dict[str, str] = field(default_factory=dict)  # neighbour node name -> reason
    finish: tuple = ()  # a row group's: per output, what makes the node's value of its rows (row_fusion)
    orders: tuple = ()  # a row group's: per output, eager's order of its dims in memory (None: contiguous)
    updates: tuple = ()  # a row group's running statistics it updates (row_fusion.build_rows)
    rows: object = None  # a row group's RowSpace

    def ops(self) -> list[str]:
        return [getattr(s, "op", None) or f"row_{s.kind}" for s in self.group.steps]


@dataclass
class Fusion:
    groups: list[FusionGroup]
    declined: list[dict]  # {"nodes", "ops", "reason"} for groups codegen refused
    alone: dict[str, dict[str, str]]  # candidate left in a group of one -> {neighbour: why not with it}


def example(info: TensorInfo) -> torch.Tensor:
    """A meta tensor with the node's shape, dtype and strides: what codegen decides on."""
    return torch.empty_strided(info.shape, info.stride, dtype=info.dtype, device="meta")


def _one_step(op: str, operands, params) -> tuple[codegen.Group, list[torch.fx.Node]]:
    inputs = list(dict.fromkeys(v for v in operands if isinstance(v, torch.fx.Node)))
    args = tuple(("input", inputs.index(v)) if isinstance(v, torch.fx.Node) else v for v in operands)
    return codegen.Group([n.name for n in inputs], [codegen.Step(op, args, params)], [0]), inputs


def classify(node: torch.fx.Node, gm: torch.fx.GraphModule, written: dict) -> Member | str:
    """Step 1 for one call node: a Member, or the reason it cannot be one."""
    if reads_attribute(node):
        return "reads a tensor attribute"
    op = ops.lookup(node, gm)
    channels = channel_norm(op)
    if channels is not None:
        return channels
    # a batch norm's running statistics: the fused call updates them as eager does
    effect = None if op is not None and op.name in BATCH_NORMS else state_effect(node, gm)
    if effect is not None:
        return effect
    if op is None:  # pure by what it dispatches (analysis/dispatched.py), yet no template computes it
        return "opaque op (the registry does not know it): no fused kernel computes it"
    bound = ops.bind(node, gm)
    row = row_member(node, gm, op, bound) or channel_layer_norm(node, gm, op)
    if row is not None:
        if isinstance(row, str):
            return row
        full, operands, params, absorbed = row
        name = "layer_norm" if op.name == "permute" else op.name  # a layer norm over channels, through permutes
        return Member(node, name, operands, params, row=full, absorbed=absorbed)
    epilogue = epilogue_member(node, op, bound)
    if epilogue is not None:
        rows, bias, kind = epilogue
        return Member(node, "add", (BiasFree(node, op.name), as_state(bias, gm)), {}, row=rows, epilogue=kind)
    if _reshapes_norm_vector(node, op, gm, written):  # joins only that norm's group (row_fusion.channel_vectors)
        return Member(node, op.name, (node.all_input_nodes[0],), {}, identity=True)
    drawn = drawn_bernoulli(node, op, bound)
    if isinstance(drawn, str):
        return drawn
    if drawn is not None:  # only its input's shape is read: not an operand
        return Member(node, op.name, (), {}, mask=drawn)
    drawing = op.random and bound is not None and training_dropout(op, bound.params)
    if op.random:
        if not drawing and (bound is None or not is_identity_dropout(op, bound.params)):
            return f"random in training ({op.name} draws a mask that no fused kernel draws)" \
                if bound and "train" in bound.params else f"random ({op.name} draws from the RNG)"
    elif op.kind != "elementwise":
        return NOT_ELEMENTWISE.format(kind=op.kind)
    elif op.triton is None:
        return f"no template ({op.name} has no Triton expression in the registry)"
    if bound is None:
        return f"its arguments do not bind to {op.name}'s operands and literal params"
    info = tensor_info(node)
    if not isinstance(info, TensorInfo):
        return "no tensor metadata (annotate the graph first)"
    if op.aliases or (op.random and not drawing):  # here: a no-op cast or an identity dropout can return its input itself
        for value in node.all_input_nodes + [node]:
            if value in written:
                return f"it may return its input itself, and {written[value]} may write {value.name}"
    tensors = [v for v in bound.operands if isinstance(v, torch.fx.Node)]
    for v in tensors:
        if not isinstance(tensor_info(v), TensorInfo):
            return f"operand {v.name} is not a tensor (a value computed at run time)"
    strided = None
    if not info.contiguous:
        if not dense(info):
            return f"eager makes it with strides {info.stride}, overlapping or with gaps; a fused kernel writes dense tensors"
        strided = f"eager makes it with strides {info.stride}; an elementwise kernel writes contiguous tensors"
    if op.random:
        source = tensor_info(tensors[0])
        if (source.shape, source.dtype) != (info.shape, info.dtype):
            return "dropout that changes shape or dtype"
        if not drawing:
            return Member(node, op.name, tuple(bound.operands), {}, identity=True)
        if strided is not None or info.dtype not in FLOATS:
            return f"a dropout in training of {info.short()}: a fused one draws contiguous float masks"
        return Member(node, op.name, tuple(bound.operands), {}, mask=DrawnMask(node, 1 - bound.params["p"], info.dtype))
    group, inputs = _one_step(op.name, bound.operands, bound.params)
    examples = [example(tensor_info(v)) for v in inputs]
    reason = codegen.supports(group, examples)
    if reason is not None:
        return f"declined by codegen: {reason}"
    dtype = codegen.step_dtypes(group, examples)[0]
    shape = tuple(codegen.step_shapes(group, [t.shape for t in examples])[0])
    if (dtype, shape) != (info.dtype, info.shape):
        return f"codegen would make {dtype}{list(shape)} where eager makes {info.dtype}{list(info.shape)}"
    if strided is not None and all(i.dtype == DTYPE for i in [info, *map(tensor_info, tensors)]):
        # a row group writes it where eager does: rows over its layout, columns along its innermost dim
        inner = min((d for d, size in enumerate(info.shape) if size != 1), key=lambda d: info.stride[d])
        return Member(node, op.name, tuple(bound.operands), dict(bound.params), row=RowSpace(info.shape, (inner,)))
    return Member(node, op.name, tuple(bound.operands), dict(bound.params), strided=strided)


def _reshapes_norm_vector(node: torch.fx.Node, op, gm: torch.fx.GraphModule, written: dict) -> bool:
    """Whether the node reshapes a vector of channels ([C, 1, 1, 1] to [C]: NFNet's
    (gain * scale).view(-1)) for batch norms' weights or biases only."""
    if not reorder_free_view(node, op, written):
        return False
    shapes = [tensor_info(v).shape for v in (node.all_input_nodes[0], node)]
    if {len([s for s in shape if s != 1]) for shape in shapes} != {1} or max(shapes[0]) != max(shapes[1]):
        return False
    for user in node.users:
        bound = ops.bind(user, gm) if user.op in CALLS else None
        if bound is None or bound.op.name not in BATCH_NORMS or node not in bound.operands[1:3] \
                or node is bound.operands[0]:
            return False
    return True


def _path(q: nx.DiGraph, a, b, names) -> list[str] | None:
    """A path a -> x -> ... -> b through some x outside a and b, as node names; None when there is none."""
    for s in q.successors(a):
        if s != b and nx.has_path(q, s, b):
            return [names[v] for v in nx.shortest_path(q, s, b)[:-1]]
    return None


@dataclass(frozen=True)
class WhyNot:
    """Why two groups may not be merged (legality): `kind` for code, `text` for the report."""

    kind: str  # "matmul", "rows", "strided", "writer", "draw" or "cycle"
    text: str

    def __str__(self) -> str:
        return self.text


class _Merging:
    """Step 2's state: the groups so far (union-find over members; a group's root is its vertex in
    the contracted graph q) and what can_merge asks of them."""

    def __init__(self, gm: torch.fx.GraphModule, members: dict):
        self.members = members
        self.q = q = nx.DiGraph()
        self.order = order = list(gm.graph.nodes)
        self.names = {n: n.name for n in order}
        for node in order:
            q.add_node(node)
            for user in node.users:
                if user in members and members[user].epilogue:  # the matmul runs outside the group, before it
                    self.names[("matmul", user)] = f"{user.name}'s matmul"
                    q.add_edge(node, ("matmul", user))
                    q.add_edge(("matmul", user), user)
                else:
                    q.add_edge(node, user)
        aliases = Aliases(gm)
        self.writers = [i for i, n in enumerate(order) if may_write(n, gm)]
        # what each may write, views included: a batch norm's running statistics are nothing a group reads
        self.writes = {i: {m for v in written_inputs(order[i], gm) for m in [v, *aliases.sharing(v)]}
                       for i in self.writers}
        self.drawers = [i for i, n in enumerate(order) if may_draw(n, gm) and not (n in members and members[n].identity)]
        position = {n: i for i, n in enumerate(order)}
        for n, m in members.items():  # the nodes a member absorbs are computed inside it: one vertex with it
            for a in m.absorbed:
                nx.contracted_nodes(q, n, a, self_loops=False, copy=False)
        # a root's first and last position (a member from the first node it absorbs)
        self.span = {n: (min(position[v] for v in (n, *members[n].absorbed)), position[n]) for n in members}
        self.parent = {n: n for n in members}
        self.rows = {n: m.row for n, m in members.items()}  # a root's row shape, once it holds a row member
        self.held = {n: [m] for n, m in members.items()}  # a root's members
        self.strided = {n: m.strided for n, m in members.items()}  # a root's reason to be a row group or nothing

    def root(self, n):
        parent = self.parent
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def can_merge(self, producer: torch.fx.Node, node: torch.fx.Node) -> WhyNot | None:
        """None when the groups of producer and node (roots apart) may be one kernel, else why not."""
        a, b = self.root(producer), self.root(node)
        full = self.rows[a] or self.rows[b]
        if full is not None:
            reason = fits_rows(self.held[a] + self.held[b], full)
            if reason is not None:
                return WhyNot("rows", f"not one row group: {reason}")
        elif self.strided[a] or self.strided[b]:
            return WhyNot("strided", self.strided[a] or self.strided[b])
        held = self.held[a] + self.held[b]
        lo, hi = min(self.span[a][0], self.span[b][0]), max(self.span[a][1], self.span[b][1])
        writer = _written_between(held, self.writers, self.writes, self.order, lo, hi)
        if writer is not None:
            return WhyNot("writer", f"{writer.name} may write memory between them")
        drawn = _drawn_between(held, self.drawers, self.order, lo, hi)
        if drawn is not None:
            return WhyNot("draw", f"{drawn.name} draws from the RNG between them: the group's masks would be "
                                  "drawn in another order than eager's")
        path = _path(self.q, a, b, self.names)
        if path is not None:
            return WhyNot("cycle", CYCLE.format(path=" -> ".join([producer.name, *path, node.name])))
        return None

    def merge(self, producer: torch.fx.Node, node: torch.fx.Node) -> None:
        a, b = self.root(producer), self.root(node)
        full = self.rows[a] or self.rows[b]
        nx.contracted_nodes(self.q, a, b, self_loops=False, copy=False)
        self.parent[b] = a
        self.span[a] = (min(self.span[a][0], self.span[b][0]), max(self.span[a][1], self.span[b][1]))
        self.rows[a] = full
        self.held[a] += self.held.pop(b)
        self.strided[a] = None if full is not None else self.strided[a] or self.strided[b]

    def producers(self, node: torch.fx.Node, refused: dict) -> list[torch.fx.Node]:
        """The candidates node's group may merge with, in the order it tries them: row groups first
        (a node eager lays out strided may join one, and then its other producers)."""
        m = self.members[node]
        producers = node.all_input_nodes
        if m.absorbed:  # it reads what the nodes it absorbs read
            producers = [p for v in (node, *m.absorbed) for p in v.all_input_nodes if p not in m.absorbed]
        if m.mask is not None and not m.operands:  # a bernoulli reads its input's shape only
            producers = []
        if m.epilogue:  # a bias add's group starts after its matmul, which reads the other inputs
            producers = [v for v in m.operands if isinstance(v, torch.fx.Node)]
            for p in node.all_input_nodes:
                if p not in producers:
                    refused[(p, node)] = WhyNot("matmul", f"{node.name}'s matmul reads it, and runs before the "
                                                          "kernel that adds its bias")
        producers = [p for p in producers if p in self.members]
        return sorted(producers, key=lambda p: self.rows[self.root(p)] is None)


def _merge(gm: torch.fx.GraphModule, members: dict) -> tuple[list[list[torch.fx.Node]], dict]:
    """Step 2: groups of member nodes, and why neighbouring members were not merged."""
    merging, refused = _Merging(gm, members), {}
    for node in gm.graph.nodes:
        if node not in members:
            continue
        for producer in merging.producers(node, refused):
            if merging.root(producer) == merging.root(node):
                continue
            why = merging.can_merge(producer, node)
            if why is None:
                merging.merge(producer, node)
            else:
                refused[(producer, node)] = why
    groups: dict = {}
    for node in gm.graph.nodes:
        if node in members:
            groups.setdefault(merging.root(node), []).append(node)
    return list(groups.values()), refused


def _between(positions: list, order: list, held: list, lo: int, hi: int, hit=lambda i: True):
    """The first node at one of these positions strictly between lo and hi, not among the
    members, for which hit(position) holds; else None."""
    inside = {m.node for m in held}
    for i in positions[bisect.bisect_right(positions, lo):bisect.bisect_left(positions, hi)]:
        if order[i] not in inside and hit(i):
            return order[i]
    return None


def _written_between(held: list, writers: list, writes: dict, order: list, lo: int, hi: int):
    """A node between the members that may write a value they read or make (the fused kernel
    reads all its inputs at one point, before it); else None."""
    touched = {m.node for m in held} | {v for m in held for v in m.operands if isinstance(v, torch.fx.Node)}
    return _between(writers, order, held, lo, hi, lambda i: bool(writes[i] & touched))


def _drawn_between(held: list, drawers: list, order: list, lo: int, hi: int):
    """A node between the members that draws from the RNG, when they hold a draw (its mask is
    drawn when the fused call runs: eager's order must hold); else None."""
    return _between(drawers, order, held, lo, hi) if any(m.mask is not None for m in held) else None


def _traffic(member: Member) -> int:
    """Bytes eager reads and writes for one node; an identity dropout returns its input untouched,
    a matmul adds its bias as it writes its result."""
    if member.identity or member.epilogue:
        return 0
    reads = sum(info_of(v).nbytes for v in dict.fromkeys(member.operands) if info_of(v) is not None)
    return reads + tensor_info(member.node).nbytes


def build(nodes: list[torch.fx.Node], members: dict) -> FusionGroup | str:
    """Step 3 for one group: its codegen Group (a RowGroup when it holds a row member), or the
    reason codegen gives for declining it."""
    inner = next((m for n in nodes if (m := members.get(n)) and m.mask and m.mask.shape_of in nodes), None)
    if inner is not None:  # the call is given that value, which it would make itself
        return f"{inner.node.name} draws at the shape of {inner.mask.shape_of.name}, which the group makes"
    full = next((members[n].row for n in nodes if n in members and members[n].row is not None), None)
    if full is not None:
        built = build_rows(nodes, members, full)
        if isinstance(built, str):
            return built
        inputs, outputs, aliases, group, finish, orders, updates = built
        return FusionGroup(nodes, inputs, outputs, aliases, group, _saved_traffic(nodes, members, inputs, outputs),
                           finish=finish, orders=orders, updates=updates, rows=full)
    inside = set(nodes)
    inputs: list[torch.fx.Node] = []
    refs: dict = {}  # member -> its value inside the group: ("input", k) or ("step", j)
    steps = []

    def ref(value):
        if not isinstance(value, (torch.fx.Node, DrawnMask)):
            return value
        if value in inside:
            return refs[value]
        if value not in inputs:
            inputs.append(value)
        return ("input", inputs.index(value))

    def step(op, *args, **params):
        steps.append(codegen.Step(op, tuple(args), params))
        return ("step", len(steps) - 1)

    for node in nodes:
        m = members[node]
        if m.identity:
            refs[node] = ref(m.operands[0])
        elif m.op == "bernoulli":
            refs[node] = emit_bernoulli(step, ref(m.mask), m.mask.dtype)
        elif m.mask is not None:
            refs[node] = emit_dropout(step, ref(m.operands[0]), ref(m.mask), m.mask.keep, m.mask.dtype)
        else:
            refs[node] = step(m.op, *(ref(v) for v in m.operands), **m.params)
    outputs, stored, aliases = group_outputs(nodes, refs, inputs)
    if not stored:
        return "dead code: nothing outside the group uses its results"
    masks = [v for v in inputs if isinstance(v, DrawnMask) and v.shape_of is None]
    if masks:  # the call draws a dropout's at the shape its other inputs broadcast to
        shape = tuple(torch.broadcast_shapes(*(info_of(v).shape for v in inputs if v not in masks)))
        smaller = next((m for m in masks if m.info.shape != shape), None)
        if smaller is not None:
            return f"{smaller.node.name} drops out a {list(smaller.info.shape)} value of a group of {list(shape)}"
    group = codegen.Group([v.name for v in inputs], steps, stored, origin=[n.name for n in nodes])
    reason = codegen.supports(group, [example(info_of(v)) for v in inputs])
    if reason is not None:
        return f"declined by codegen: {reason}"
    return FusionGroup(nodes, inputs, outputs, aliases, group, _saved_traffic(nodes, members, inputs, outputs))


def _saved_traffic(nodes, members, inputs, outputs) -> int:
    eager = sum(_traffic(members[n]) for n in nodes if n in members)
    return eager - sum(info_of(v).nbytes for v in inputs) - sum(tensor_info(n).nbytes for n in outputs)


def _neighbours(nodes: list, reasons: dict, refused: dict) -> dict[str, str]:
    """Step 4: each call node next to the nodes but not among them, with the reason."""
    out = {}
    for node in nodes:
        edges = [(p, node) for p in node.all_input_nodes] + [(node, u) for u in node.users]
        for a, b in edges:
            other = b if a is node else a
            if other in nodes or other.op not in CALLS or other.name in out:
                continue
            # a candidate on the other side was refused on this very edge (step 2 tries every one)
            reason = reasons.get(other) or refused.get((a, b))
            if reason is not None:
                out[other.name] = str(reason)
    return out


def candidates(gm: torch.fx.GraphModule, written: dict | None = None) -> tuple[dict, dict]:
    """Step 1: (node -> Member for each candidate, node -> the reason for each other call node)."""
    written = written_values(gm) if written is None else written
    members, reasons = {}, {}
    inputless = set()
    for node in gm.graph.nodes:
        if node.op not in CALLS:
            continue
        if all(i in inputless for i in node.all_input_nodes):
            inputless.add(node)
            reasons[node] = "computed from no input of the graph: a table eager makes with its own rounding"
            continue
        found = classify(node, gm, written)
        if isinstance(found, Member):
            members[node] = found
        else:
            reasons[node] = found
    for node, m in list(members.items()):
        why = bias_add_pays(node, members) if m.epilogue else None  # a profit refusal, not a legality one
        if why is not None:
            members.pop(node)
            reasons[node] = why
        for a in m.absorbed:
            members.pop(a, None)
            reasons[a] = f"computed inside {node.name}'s kernel, which reads {m.operands[0].name}" + (
                " shifted" if m.op == "cat" else f" with its columns along dim {m.row.col_dims[0]}")
    return members, reasons


def find_groups(gm: torch.fx.GraphModule) -> Fusion:
    """Groups of elementwise nodes that can become one fused kernel each (see the module docstring)."""
    # Step 1
    members, reasons = candidates(gm)
    # Step 2
    node_groups, refused = _merge(gm, members)
    # Step 3
    groups, declined, single = [], [], []
    position = {n: i for i, n in enumerate(gm.graph.nodes)}  # finding groups rewrites nothing
    for nodes in node_groups:
        if not group_pays(nodes, members):
            single += [n for n in nodes if not members[n].identity and not members[n].epilogue]
            continue
        nodes = sorted(nodes + [a for n in nodes for a in members[n].absorbed], key=position.__getitem__)
        built = build(nodes, members)
        if isinstance(built, str):
            declined.append({"nodes": [n.name for n in nodes], "ops": [members[n].op for n in nodes],
                             "reason": built})
        else:
            groups.append(built)
    # Step 4
    for g in groups:
        g.not_fused = _neighbours(g.nodes, reasons, refused)
    alone = {n.name: _neighbours([n], reasons, refused) for n in single}
    return Fusion(groups, declined, alone)


def memory_bound(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """Whether the node runs an op bound by memory traffic (elementwise, casts, reductions, norms,
    softmaxes, losses, dropout) on floating-point values outside any fused kernel. Integer and
    boolean bookkeeping (positions, a batch norm's batch count, masks built from indices) is
    left out, and so is a cast to the dtype a tensor has, which moves nothing (ATen's to()
    returns the tensor itself)."""
    if node.op not in CALLS or reads_attribute(node):
        return False
    op = ops.lookup(node, gm)
    if op is None or op.kind not in MEMORY_BOUND or not any(i.dtype.is_floating_point for i in leaves(tensor_info(node))):
        return False
    if op.aliases:
        bound = ops.bind(node, gm)
        source = bound.operands[0] if bound is not None and bound.operands else None
        if isinstance(source, torch.fx.Node) and tensor_info(source) == tensor_info(node):
            return False
    return True


def traffic(node: torch.fx.Node) -> tuple[int, int]:
    """(bytes read, bytes written) by one run of the node: its tensor inputs and outputs."""
    read = sum(i.nbytes for v in dict.fromkeys(node.all_input_nodes) for i in leaves(tensor_info(v)))
    return read, sum(i.nbytes for i in leaves(tensor_info(node)))

