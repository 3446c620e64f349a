"""The operator-level planning problem: one decision per operator and per source tensor, with priced
options, and priced edges between them. Built from a captured `Graph` and its strategy space; solved by
`loom.plan.solve`.

- An operator's options are its candidates (`loom.plan.space`); each costs its compute time, forward and
  backward, at the candidate's share of the work (a roofline: flops over the device's achieved peak, or
  bytes over its achieved memory bandwidth, whichever is longer), and keeps activation bytes for backward.
- A source's options (a parameter, a buffer) are its free layouts (`space.layouts`); a trainable
  parameter keeps 4 copies of its local slice (weights, gradient, two optimizer states). An input has one:
  its rows cut along `BATCH_AXIS`, as `loom.parallelize` hands a batch over.
- An edge (an output read as an operator's input) costs, for each pair of producer output layout and
  consumer requirement, the forward redistribution plus, when gradients flow over it, the gradient's way
  back (`loom.plan.redistribute`): a data-parallel weight's gradient all-reduce is such an edge cost. Where
  DTensor's dispatcher makes the move (between two operators of one module), it makes it outside
  autograd: the consumer's backward moves a saved input again (`moved_again`), priced twice; and a pair
  DTensor would never run (`settled_by_dispatcher`) costs infinity (the solver never picks it).

With repeated blocks, block 0 stands for every block: its operators, parameters and inner edges weigh
`Blocks.count`; edges from one traced block to the next, and from operators outside into later blocks,
weigh `count - 1` in all; the rest weigh 1. So the whole model is priced as boundaries + count x block.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch.distributed.tensor import Replicate, Shard

from loom.cost.hardware import Cluster, get_cluster
from loom.plan._dtensor_rules import cuts_a_dim_twice, is_cut, is_strided, refuses_dims_cut_twice
from loom.plan.graph import Graph, Node, Ref, TensorInfo
from loom.plan.redistribute import axis_spans, gradient_layouts, redistribution
from loom.plan.space import Candidate, Placements, StrategySpace, layouts, strategy_space

__all__ = [
    "OPTIMIZER_COPIES",
    "Decision",
    "EdgeCost",
    "Problem",
    "build_problem",
    "compute_time",
    "local_bytes",
]

OPTIMIZER_COPIES = 4
"""Copies of a trainable parameter each device keeps: weights, gradient, Adam's two moments."""

BATCH_AXIS = "dp"
"""The mesh axis inputs arrive cut along (their rows), as `loom.parallelize` distributes a batch."""

DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # torch's names -> the cost model's


@dataclass(kw_only=True)
class Decision:
    """One choice the solver makes: `name` (a graph node), its `options` (Candidates for an operator,
    placements for a source), each option's `cost` (seconds, weighted) and `memory` (bytes per device,
    weighted), and `weight` (how many times the model holds it)."""

    name: str
    kind: str
    options: list
    cost: list[float]
    memory: list[float]
    weight: float


@dataclass(kw_only=True)
class EdgeCost:
    """Tensor `ref` read as input `index` of operator `target` (`weight` times in the model): `producer`
    groups the producer's options by the layout they give the tensor, `consumer` the consumer's options
    by what they require of it, and `cost[i][j]` prices group i feeding group j (seconds, weighted; infinite
    where the consumer cannot receive group i's layout at all, `refuses_dims_cut_twice`);
    `memory[i][j]` the bytes per device (weighted) of the copy that move makes and keeps for backward (empty:
    none, as for every edge but a parameter's into a reader that keeps it)."""

    ref: Ref
    target: str
    index: int
    tensor: TensorInfo
    weight: float
    producer: list[tuple[Placements, list[int]]]
    consumer: list[tuple[tuple, list[int]]]
    cost: list[list[float]] = field(default_factory=list)
    memory: list[list[float]] = field(default_factory=list)


@dataclass(kw_only=True)
class Problem:
    """Decisions and edges of one graph on one mesh and cluster (see the module notes)."""

    graph: Graph
    mesh: dict[str, int]
    cluster: Cluster
    space: StrategySpace
    decisions: dict[str, Decision]
    edges: list[EdgeCost]
    canon: dict[str, str]  # node -> the node whose decision stands for it (block 0's, a tied tensor's first)


def build_problem(
    graph: Graph,
    mesh: Mapping[str, int],
    cluster: Cluster | str = "h100-sxm",
    space: StrategySpace | None = None,
) -> Problem:
    """The planning problem of `graph` on `mesh`, priced on `cluster` (a `Cluster` or a profile name)."""
    mesh = dict(mesh)
    devices = math.prod(mesh.values())
    if isinstance(cluster, str):
        cluster = get_cluster(cluster, gpus=devices)
    space = strategy_space(graph, mesh) if space is None else space
    blocks = _BlockMap(graph)
    decisions = {
        name: _op_decision(graph, graph[name], space[name].candidates, blocks, mesh, cluster)
        for name in space.ops
    }
    merged: dict[tuple[Ref, str, int], float] = defaultdict(float)
    for node in graph.ops():
        for index, ref in enumerate(node.inputs):
            weight = blocks.edge_weight(ref.node, node.name)
            if weight:
                merged[(Ref(blocks.canon(ref.node), ref.index), blocks.canon(node.name), index)] += weight
    for k, ref in enumerate(graph.outputs):
        if ref is not None and graph[ref.node].is_op:
            sink = f"output{k}"  # the caller reads the output whole or cut, never as pending partial sums
            decisions[sink] = _output_decision(sink, graph.tensor(ref), mesh)
            merged[(Ref(blocks.canon(ref.node), ref.index), sink, 0)] += 1.0
    spans = axis_spans(mesh, cluster)
    cache: dict = {}
    edges = []
    for (ref, target, index), weight in merged.items():
        if target not in decisions:
            continue
        if ref.node not in decisions:
            decisions[ref.node] = _source_decision(graph, graph[ref.node], mesh, blocks)
        edges.append(_edge(graph, ref, target, index, weight, decisions, mesh, cluster, spans, cache))
    return Problem(
        graph=graph,
        mesh=mesh,
        cluster=cluster,
        space=space,
        decisions=decisions,
        edges=edges,
        canon=blocks.to_zero,
    )


# ---- decisions ----


def _op_decision(
    graph: Graph,
    node: Node,
    candidates: tuple[Candidate, ...],
    blocks: _BlockMap,
    mesh: dict,
    cluster: Cluster,
) -> Decision:
    weight = blocks.weight(node.name)
    return Decision(
        name=node.name,
        kind="op",
        options=list(candidates),
        cost=[weight * compute_time(node, c.total_share, cluster) for c in candidates],
        memory=[weight * _activation_bytes(graph, node, c, mesh) for c in candidates],
        weight=weight,
    )


def compute_time(node: Node, share: float, cluster: Cluster) -> float:
    """Seconds of `node`'s forward and backward on one device doing `share` of the work."""
    device = cluster.device
    dtype = DTYPE_NAMES.get(node.outputs[0].dtype if node.outputs and node.outputs[0] else "", "fp32")
    flops_rate = device.peak(dtype) * device.matmul_efficiency
    bytes_rate = device.memory_bandwidth * device.memory_efficiency
    kernels = [(node.flops, node.bytes), *((op.flops, op.bytes) for op in node.backward)]
    return sum(share * max(f / flops_rate, b / bytes_rate) for f, b in kernels if f or b)


def _activation_bytes(graph: Graph, node: Node, candidate: Candidate, mesh: Mapping[str, int]) -> float:
    """Bytes of the tensors the operator keeps for its backward, at the candidate's layouts (parameters and
    their views aside: a parameter is counted once, with its layout, and a moved copy of it on the edge
    that moves it, `_kept_copy_bytes`)."""
    total = 0.0
    for ref in node.saved:
        if ref.node == node.name:
            info, ps = node.outputs[ref.index], candidate.outputs[ref.index]
        elif ref in node.inputs and not _aliases_parameter(graph, ref):
            info, ps = graph.tensor(ref), candidate.inputs[node.inputs.index(ref)]
        else:
            continue
        if ps is not None and info is not None:
            total += local_bytes(info, ps, mesh)
    return total


def _is_parameter(graph: Graph, ref: Ref) -> bool:
    return graph[ref.node].kind in ("parameter", "buffer")


def _aliases_parameter(graph: Graph, ref: Ref) -> bool:
    """Whether `ref` is a parameter (or buffer), or a view of one (a linear weight's `t`): it shares the
    parameter's storage wherever no move made a copy of it."""
    while graph[ref.node].is_view:
        ref = graph[ref.node].inputs[0]
    return _is_parameter(graph, ref)


def _kept_for_backward(graph: Graph, ref: Ref, target: str) -> bool:
    """Whether operator `target` keeps its input `ref` for its backward, itself or, for a view, through
    the readers of its output that keep that (a matmul keeps its weight's transposed view)."""
    node = graph[target] if target in graph else None
    if node is None or not node.is_op:
        return False
    if ref in node.saved:
        return True
    outs = [Ref(target, k) for k in range(len(node.outputs))]  # a split's pieces too
    return node.is_view and any(
        _kept_for_backward(graph, out, user) for user in graph.users(target) for out in outs
    )


def _kept_copy_bytes(graph, ref, target, mesh, producer, consumer) -> list[list[float]] | None:
    """Bytes per device of the copy a move of parameter `ref` (or a view of one) into `target` makes and
    autograd keeps until the backward, for each pair of the edge's producer and consumer groups (0 where
    nothing moves), or None where no such copy lives (the consumer does not keep the input). Such a copy
    is what ZeRO-3-like layouts pay beside their shards: every gathered weight of the forward, until its
    backward."""
    if not (_aliases_parameter(graph, ref) and _kept_for_backward(graph, ref, target)):
        return None
    info = graph.tensor(ref)
    return [
        [0.0 if required == out else local_bytes(info, required, mesh) for (required, _), _ in consumer]
        for out, _ in producer
    ]


def local_bytes(info: TensorInfo, placements: Placements, mesh: Mapping[str, int]) -> float:
    """Bytes of one device's slice of `info` laid out as `placements` on `mesh`."""
    cuts = math.prod(n for p, n in zip(placements, mesh.values(), strict=True) if is_cut(p))
    return info.nbytes / cuts


def _source_decision(graph: Graph, node: Node, mesh: dict[str, int], blocks: _BlockMap) -> Decision:
    info = node.output(0)
    options = [_batch_layout(info, mesh)] if node.kind == "input" else layouts(info, mesh)
    param = graph.params.get(node.target)
    copies = OPTIMIZER_COPIES if param is not None and param.trainable else 1 if param is not None else 0
    weight = blocks.weight(node.name)
    local = [local_bytes(info, ps, mesh) for ps in options]
    return Decision(
        name=node.name,
        kind=node.kind,
        options=options,
        cost=[0.0] * len(options),
        memory=[weight * copies * b for b in local],
        weight=weight,
    )


def _batch_layout(info: TensorInfo, mesh: Mapping[str, int]) -> Placements:
    """An input as `loom.parallelize` hands it over: rows cut along `BATCH_AXIS` (when they divide),
    whole along the other axes."""
    rows = info.shape[0] if info.ndim else 0
    cut = BATCH_AXIS in mesh and rows >= mesh[BATCH_AXIS] and rows % mesh[BATCH_AXIS] == 0
    return tuple(Shard(0) if axis == BATCH_AXIS and cut else Replicate() for axis in mesh)


def _output_decision(name: str, info: TensorInfo, mesh: dict[str, int]) -> Decision:
    options = layouts(info, mesh)
    return Decision(
        name=name,
        kind="output",
        options=options,
        cost=[0.0] * len(options),
        memory=[0.0] * len(options),
        weight=1.0,
    )


def requirement(
    decision: Decision, option: int, index: int, mesh: Mapping[str, int]
) -> tuple[Placements, tuple]:
    """What option `option` of a consumer requires of its input `index` (placements), and the mesh axes
    along which it cuts its work (a graph output is read as it is, its work not cut)."""
    chosen = decision.options[option]
    if decision.kind != "op":
        return chosen, tuple(False for _ in mesh)
    return chosen.inputs[index], tuple(chosen.share[axis] < 1 for axis in mesh)


def _price(nbytes, out, required, split, grads, again, mesh, cluster, spans) -> float:
    """Seconds of the forward redistribution of a tensor of `nbytes` (twice when `again`: its consumer's
    backward reads the tensor as it arrived and DTensor moves it again), and of the gradient's way back
    when `grads`."""
    moves = 2 if again else 1
    seconds = moves * sum(s.seconds for s in redistribution(nbytes, out, required, mesh, cluster, spans))
    if grads:
        left, wanted = gradient_layouts(out, required, split)
        seconds += sum(s.seconds for s in redistribution(nbytes, left, wanted, mesh, cluster, spans))
    return seconds


def _code(placements: Placements) -> tuple[int | tuple[int, int], ...]:
    """Placements as plain numbers (a dim for a cut, (dim, split factor) for a strided cut, -1 whole, -2
    partial): cheap to hash, so that every block's edges, which repeat the same few sizes and layouts, are
    priced once. A strided cut has a code of its own: read as whole, its moves were priced as free."""
    return tuple(
        (p.dim, p.split_factor) if is_strided(p)
        else p.dim if isinstance(p, Shard)
        else -2 if p.is_partial()
        else -1
        for p in placements
    )  # fmt: skip


def dispatcher_moves(graph: Graph, ref: Ref, target: str) -> bool:
    """Whether only DTensor's dispatcher may move `ref` into operator `target`: both are operators of one
    module, and a plan's hooks move tensors only where they enter or leave a module. A view of a parameter
    (a linear weight's `t`) is not such a tensor: the plan's `compute_layouts` hook moves the parameter
    itself, before its views, to the layout its reader requires through them."""
    source, reader = graph[ref.node], graph[target] if target in graph else None
    if reader is None or not (source.is_op and reader.is_op) or _aliases_parameter(graph, ref):
        return False
    return source.module == reader.module


def moved_again(graph: Graph, ref: Ref, target: str) -> bool:
    """Whether a move of `ref` into operator `target` runs again in backward: DTensor's dispatcher moves it
    (`dispatcher_moves`) inside `target`'s dispatch, outside autograd, so autograd keeps the tensor as it
    arrived (`target` saves it for its backward), and the backward operator reading it is dispatched on
    it as kept and moves it again."""
    reader = graph[target] if target in graph else None
    return dispatcher_moves(graph, ref, target) and reader.requires_grad and ref in reader.saved


def settled_by_dispatcher(graph: Graph, ref: Ref, target: str) -> bool:
    """Whether DTensor's dispatcher picks `target`'s strategy from the layout `ref` arrives in, every other
    tensor `target` reads arriving as the chosen candidate requires: only the dispatcher moves `ref` there
    (`dispatcher_moves`), and `target`'s other tensor inputs are parameters or buffers, each read in the
    layout the solver chose for it (kept so, or moved there by its `compute_layouts` hook). For such an
    operator, a candidate reading `ref` as it arrives costs DTensor no move of it, where any other costs
    one: DTensor never runs a candidate that moves `ref` with a collective when one reads it as made (an
    RMSNorm's `weight * hidden_states` gathers the weight rather than move the hidden states)."""
    if not dispatcher_moves(graph, ref, target):
        return False
    others = [other for other in graph[target].inputs if other != ref]
    return all(graph[other.node].kind in ("parameter", "buffer") for other in others)


def carries_gradient(graph: Graph, ref: Ref, target: str) -> bool:
    """Whether a gradient flows back over the edge from `ref` to operator `target` (or a graph output)."""
    source = graph[ref.node]
    param = graph.params.get(source.target) if not source.is_op else None
    differentiable = source.requires_grad if source.is_op else param is not None and param.trainable
    reader = graph[target].requires_grad if target in graph else True
    return differentiable and reader and graph.tensor(ref).floating


# ---- edges ----


def _edge(graph, ref, target, index, weight, decisions, mesh, cluster, spans, cache) -> EdgeCost:
    info = graph.tensor(ref)
    producer, consumer = decisions[ref.node], decisions[target]
    out_groups: dict[Placements, list[int]] = defaultdict(list)
    for i, option in enumerate(producer.options):
        out_groups[option.outputs[ref.index] if producer.kind == "op" else option].append(i)
    in_groups: dict[tuple, list[int]] = defaultdict(list)
    for i in range(len(consumer.options)):
        in_groups[requirement(consumer, i, index, mesh)].append(i)
    grads = carries_gradient(graph, ref, target)
    again = moved_again(graph, ref, target)
    codes = {ps: _code(ps) for ps in [*out_groups, *(required for required, _ in in_groups)]}
    # layouts the consumer has a candidate reading as they are, where the dispatcher settles it
    as_made = {required for required, _ in in_groups} if settled_by_dispatcher(graph, ref, target) else set()
    cost = []
    for out in out_groups:
        row = []
        for required, split in in_groups:
            if (
                out in as_made
                and out != required
                and _collective(codes[out], codes[required], out, required, mesh, cluster, spans, cache)
            ):
                row.append(math.inf)  # DTensor would read it as made: never what runs
                continue
            key = (codes[out], codes[required], split if grads else None, again)
            if key not in cache:  # seconds = fixed + per byte * size: price two sizes once
                one, two = (
                    _price(n, out, required, split, grads, again, mesh, cluster, spans) for n in (1.0, 2.0)
                )
                cache[key] = (2 * one - two, two - one)
            fixed, per_byte = cache[key]
            row.append(weight * (fixed + per_byte * info.nbytes) if info.nbytes else 0.0)
        cost.append(row)
    if target in graph and graph[target].is_op and refuses_dims_cut_twice(graph[target].op):
        # DTensor reads the arriving layout by its rule before it could move it: such an arrival cannot run
        cost = [
            [math.inf] * len(row) if cuts_a_dim_twice(out) else row
            for out, row in zip(out_groups, cost, strict=True)
        ]
    kept = _kept_copy_bytes(graph, ref, target, mesh, list(out_groups.items()), list(in_groups.items()))
    return EdgeCost(
        ref=ref,
        target=target,
        index=index,
        tensor=info,
        weight=weight,
        producer=list(out_groups.items()),
        consumer=list(in_groups.items()),
        cost=cost,
        memory=[[weight * b for b in row] for row in kept] if kept else [],
    )


def _collective(code_out, code_in, out, required, mesh, cluster, spans, cache) -> bool:
    """Whether moving `out` to `required` runs a collective (not a slice alone), asked once per pair of
    layout codes (`_code`) in the edges' price `cache`."""
    key = ("collective", code_out, code_in)
    if key not in cache:
        cache[key] = bool(redistribution(1.0, out, required, mesh, cluster, spans))
    return cache[key]


# ---- blocks ----


def _tied(graph: Graph) -> dict[str, str]:
    """Each parameter node lifted under another name of the same (tied) tensor -> the first such node:
    one decision lays out, and one copy of memory holds, a tied embedding and head."""
    first: dict[str, str] = {}
    for param in graph.params.values():
        for alias in param.aliases:
            other = graph.params.get(alias)
            if other is not None and graph.nodes.index(graph[other.node]) < graph.nodes.index(
                graph[param.node]
            ):
                first[param.node] = first.get(other.node, other.node)
    return first


class _BlockMap:
    """Maps every node of a traced block to its counterpart in block 0, and weighs nodes and edges so that
    block 0 stands for all `Blocks.count` blocks (see the module notes)."""

    def __init__(self, graph: Graph) -> None:
        self.graph, self.blocks = graph, graph.blocks
        self.to_zero: dict[str, str] = _tied(graph)
        self.block_of: dict[str, int] = {}
        if self.blocks is None:
            return
        for b, names in enumerate(self.blocks.nodes):
            for name, zero in zip(names, self.blocks.nodes[0], strict=True):
                self.to_zero[name], self.block_of[name] = zero, b
        by_target = {node.target: node.name for node in graph.nodes if not node.is_op}
        prefix = self.blocks.path + "."
        for node in graph.nodes:
            if node.is_op or not node.target.startswith(prefix):
                continue
            index, _, rest = node.target[len(prefix) :].partition(".")
            if index.isdigit() and int(index) < self.blocks.traced:
                self.block_of[node.name] = int(index)
                self.to_zero[node.name] = by_target.get(f"{prefix}0.{rest}", node.name)

    def canon(self, name: str) -> str:
        """The block-0 counterpart of `name` (itself outside the blocks)."""
        return self.to_zero.get(name, name)

    def weight(self, name: str) -> float:
        """How many times the model runs (or holds) block-0 node `name`."""
        return float(self.blocks.count) if self.block_of.get(name) == 0 else 1.0

    def edge_weight(self, source: str, target: str) -> float:
        """How many of the model's edges the traced edge `source -> target` stands for (0: another edge
        already stands for it)."""
        if self.blocks is None:
            return 1.0
        b_source, b_target = self.block_of.get(source), self.block_of.get(target)
        count, traced = self.blocks.count, self.blocks.traced
        if b_target is None:
            return 1.0
        if b_target == 0:
            return float(count) if b_source == 0 else 1.0
        if b_source == b_target:
            return 0.0  # block 0's own edge stands for it
        return (count - 1) / (traced - 1)
