"""The strategy space: the layouts each operator of a captured `Graph` can run in, from DTensor's rules.

    space = strategy_space(graph, {"dp": 2, "tp": 4})
    for candidate in space[node_name].candidates:
        candidate.inputs, candidate.outputs, candidate.share

A candidate is DTensor placements: for each tensor input of the operator the placements it must arrive in
(one per mesh axis, `Shard(d)` / `Replicate()` / `Partial()`), the placements of its outputs, and per mesh
axis the share of the operator's work one device does (1/4 when a 4-device axis splits it, 1 when the axis
repeats it). A solver picks one candidate per operator and pays, on each edge of the graph (`edges`), the
redistribution from the producer's output placements to the placements the consumer requires, priced by
`loom.cost` from the tensor's size; the operator itself costs its flops and bytes (`Node.flops`,
`Node.bytes`, `Node.backward`) times its shares. Nothing is priced here.

How candidates are found, per mesh axis: every combination of input placements (each input `Replicate`,
`Partial`, or `Shard` of a dim the axis divides) is put to DTensor's own sharding propagation
(`loom.plan._dtensor_rules`); its answers (the input placements it requires, the output placements) are the
axis's candidates, without repeats. An operator DTensor has no rule for gets one candidate: replicate
everything (`source="replicate"`). Candidates on the whole mesh are the products of the axes' candidates
(as DTensor expands its single-axis strategies), keeping those that cut no dim into more parts than it has.
Identical operators on identical shapes (every block of a transformer) are enumerated once.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from loom.plan import _dtensor_rules
from loom.plan.graph import Graph, Node, Ref, TensorInfo
from loom.plan.opcost import meta_tensor, op_bytes, op_flops

__all__ = ["Candidate", "Edge", "OpSpace", "StrategySpace", "edges", "layouts", "op_space", "strategy_space"]

MAX_COMBINATIONS = 512
"""Input placement combinations tried per operator and axis; past this (a concatenation of many tensors),
only combinations that give every input the same kind of placement, or vary one input alone, are tried."""

Placements = tuple[Placement, ...]  # one placement per mesh axis


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way to run an operator: `inputs[i]` the placements tensor input i must have (in `Node.inputs`
    order), `outputs[j]` the placements of output j (None: not a tensor), `share[axis]` the fraction of the
    operator's flops (bytes for an operator without flops) one device does along that axis. `source`:
    `"dtensor"` (DTensor's rule), `"replicate"` (no rule: everything whole on every device) or `"factory"`
    (an operator without tensor inputs, `arange`: its output is made whole on every device)."""

    inputs: tuple[Placements, ...]
    outputs: tuple[Placements | None, ...]
    share: Mapping[str, float]
    source: str = "dtensor"

    @property
    def total_share(self) -> float:
        """The fraction of the operator's work one device does on the whole mesh."""
        return math.prod(self.share.values())

    def describe(self) -> str:
        """`(S(1), S(0)) -> P` style text, axes separated by `|`."""
        show = lambda ps: "|".join(_short(p) for p in ps) if ps is not None else "-"
        return (
            f"({', '.join(show(ps) for ps in self.inputs)}) -> {', '.join(show(ps) for ps in self.outputs)}"
        )


@dataclass(frozen=True, kw_only=True)
class OpSpace:
    """The candidates of one op node on a mesh (`candidates`), and per axis (`per_axis`, placements of one
    entry each), with whether DTensor had no rule (`fallback`)."""

    node: str
    target: str
    candidates: tuple[Candidate, ...]
    per_axis: Mapping[str, tuple[Candidate, ...]]
    fallback: bool


@dataclass(frozen=True, kw_only=True)
class Edge:
    """Output `source` of one node read as tensor input `index` of op node `target`."""

    source: Ref
    target: str
    index: int
    tensor: TensorInfo


@dataclass(frozen=True, kw_only=True)
class StrategySpace:
    """The candidates of op nodes on one mesh (`mesh`: axis name -> size, outermost first)."""

    mesh: Mapping[str, int]
    ops: Mapping[str, OpSpace]

    def __getitem__(self, node: str) -> OpSpace:
        return self.ops[node]

    def __len__(self) -> int:
        return len(self.ops)

    def fallbacks(self) -> list[str]:
        """The operators (targets) DTensor has no rule for, replicated."""
        return sorted({space.target for space in self.ops.values() if space.fallback})


def strategy_space(
    graph: Graph,
    mesh: Mapping[str, int],
    nodes: Iterable[str] | None = None,
    cache: dict[str, tuple[Candidate, ...]] | None = None,
) -> StrategySpace:
    """The candidates of `nodes` (default: every op node; with repeated blocks, block 0 and the operators
    outside the blocks, which stand for the whole model) on `mesh`. `cache` (see `op_space`) may be shared
    between the spaces of several meshes of one graph: an axis's candidates depend only on its size, so
    dp 2 x tp 4 reuses what dp 4 x tp 2 asked DTensor's rules."""
    mesh = _checked_mesh(mesh)
    if nodes is None:
        nodes = _standing_nodes(graph)
    cache = {} if cache is None else cache
    return StrategySpace(mesh=mesh, ops={name: op_space(graph, name, mesh, cache) for name in nodes})


def op_space(
    graph: Graph, name: str, mesh: Mapping[str, int], cache: dict[str, tuple[Candidate, ...]] | None = None
) -> OpSpace:
    """The candidates of op node `name` on `mesh` (`cache`: shared between calls, keyed by operator,
    arguments, shapes and axis size)."""
    mesh = _checked_mesh(mesh)
    node = graph[name]
    if not node.is_op:
        raise ValueError(f"{name} is a {node.kind}, not an operator: its layouts are free (see `layouts`)")
    cache = {} if cache is None else cache
    infos = [graph.tensor(ref) for ref in node.inputs]
    per_axis = {}
    for axis, size in mesh.items():
        key = repr((node.target, node.skeleton(), infos, node.outputs, size))
        if key not in cache:
            cache[key] = _axis_candidates(node, infos, size)
        per_axis[axis] = tuple(_named(c, axis) for c in cache[key])
    fallback = any(c.source == "replicate" for options in per_axis.values() for c in options)
    combined = tuple(c for c in _combine(per_axis, infos, node.outputs, mesh) if c is not None)
    if _dtensor_rules.refuses_dims_cut_twice(node.op):
        tensors = lambda c: (*c.inputs, *(o for o in c.outputs if o is not None))  # noqa: E731
        combined = tuple(c for c in combined if not any(map(_dtensor_rules.cuts_a_dim_twice, tensors(c))))
    return OpSpace(node=name, target=node.target, candidates=combined, per_axis=per_axis, fallback=fallback)


def edges(graph: Graph, nodes: Iterable[str]) -> list[Edge]:
    """Every tensor input of the op nodes `nodes`: where a solver prices redistributions."""
    found = []
    for name in nodes:
        for index, ref in enumerate(graph[name].inputs):
            found.append(Edge(source=ref, target=name, index=index, tensor=graph.tensor(ref)))
    return found


def layouts(info: TensorInfo, mesh: Mapping[str, int]) -> list[Placements]:
    """Every layout of a source tensor (a parameter, an input) on `mesh`: per axis `Replicate` or `Shard`
    of a dim, no dim cut into more parts than it has."""
    mesh = _checked_mesh(mesh)
    options = [_tensor_options(info, size, partial=False) for size in mesh.values()]
    return [ps for ps in itertools.product(*options) if _fits(info, ps, list(mesh.values()))]


# ---- one axis ----


def _axis_candidates(node: Node, infos: list[TensorInfo], size: int) -> tuple[Candidate, ...]:
    """The candidates of `node` on one axis of `size` devices (axis named "" until `_named`)."""
    if not infos:  # a factory (arange, full): made whole on every device, no rule needed
        return (dataclasses.replace(_replicated(node, infos, size), source="factory"),)
    tensors = [meta_tensor(info) for info in infos]
    args, kwargs = node.call_args(tensors)
    found: dict[tuple, Candidate] = {}
    for placements in _combinations(infos, size):
        proposal = _dtensor_rules.propose(node.op, args, kwargs, placements, size)
        if proposal is None or len(proposal.outputs) != len(node.outputs):
            continue
        key = (proposal.inputs, proposal.outputs)
        if key not in found and _fits_all(infos, node.outputs, proposal.inputs, proposal.outputs, size):
            found[key] = Candidate(
                inputs=tuple((p,) for p in proposal.inputs),
                outputs=tuple((p,) if p is not None else None for p in proposal.outputs),
                share={"": _share(node, infos, proposal.inputs, proposal.outputs, size)},
            )
    return tuple(found.values()) or (_replicated(node, infos, size),)


def _replicated(node: Node, infos: list[TensorInfo], size: int) -> Candidate:
    return Candidate(
        inputs=tuple((Replicate(),) for _ in infos),
        outputs=tuple((Replicate(),) if out is not None else None for out in node.outputs),
        share={"": 1.0},
        source="replicate",
    )


def _combinations(infos: list[TensorInfo], size: int) -> Iterable[tuple[Placement, ...]]:
    """Input placement combinations to try (see `MAX_COMBINATIONS`)."""
    options = [_tensor_options(info, size, partial=True) for info in infos]
    if math.prod(len(o) for o in options) <= MAX_COMBINATIONS:
        return itertools.product(*options)
    kinds: list[tuple[Placement, ...]] = [
        tuple(Replicate() for _ in infos),
        tuple(Partial() if info.floating else Replicate() for info in infos),
    ]
    for dim in range(max(info.ndim for info in infos)):
        kinds.append(tuple(Shard(dim) if dim < info.ndim else Replicate() for info in infos))
    for i, choices in enumerate(options):
        for choice in choices:
            kinds.append(tuple(choice if j == i else Replicate() for j in range(len(infos))))
    return dict.fromkeys(kinds)


def _tensor_options(info: TensorInfo, size: int, *, partial: bool) -> list[Placement]:
    """Placements of one tensor on an axis of `size`: Replicate, Partial (floating tensors, when asked),
    and Shard of every dim that `size` divides."""
    options: list[Placement] = [Replicate()]
    if partial and info.floating:
        options.append(Partial())
    options += [Shard(d) for d, n in enumerate(info.shape) if n >= size and n % size == 0]
    return options


def _share(node: Node, infos: list[TensorInfo], ins: Sequence[Placement], outs: Sequence, size: int) -> float:
    """The fraction of the operator's work one device does: flops on the local shapes over flops on the
    whole ones, or bytes when the operator has no flops (views: the output's fraction)."""
    local_in = [_local(info, p, size) for info, p in zip(infos, ins, strict=True)]
    local_out = [
        _local(info, p, size) if info is not None else None
        for info, p in zip(node.outputs, outs, strict=True)
    ]
    if node.flops:
        args, kwargs = node.call_args(
            [meta_tensor(info, shape) for info, shape in zip(infos, local_in, strict=True)]
        )
        out = [
            meta_tensor(info, shape)
            for info, shape in zip(node.outputs, local_out, strict=True)
            if info is not None
        ]
        flops = op_flops(node.op, args, kwargs, out[0] if len(out) == 1 else tuple(out))
        return flops / node.flops
    whole_out = [info for info in node.outputs if info is not None]
    part = lambda shapes, whole: [
        _resized(info, shape) for info, shape in zip(whole, shapes, strict=True) if info
    ]
    if node.bytes:
        parts = op_bytes(
            node.op, part(local_in, infos), part([s for s in local_out if s is not None], whole_out)
        )
        return parts / node.bytes
    sizes = [
        (math.prod(s), info.numel)
        for s, info in zip([s for s in local_out if s is not None], whole_out, strict=True)
    ]
    return sum(a for a, _ in sizes) / max(1, sum(b for _, b in sizes))


def _local(info: TensorInfo, placement: Placement, size: int) -> tuple[int, ...]:
    shape = list(info.shape)
    if _dtensor_rules.is_cut(placement):
        shape[placement.dim] = -(-shape[placement.dim] // size)
    return tuple(shape)


def _resized(info: TensorInfo, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo(shape=shape, stride=info.stride, dtype=info.dtype, itemsize=info.itemsize)


# ---- the whole mesh ----


def _named(candidate: Candidate, axis: str) -> Candidate:
    return Candidate(
        inputs=candidate.inputs,
        outputs=candidate.outputs,
        share={axis: candidate.share[""]},
        source=candidate.source,
    )


def _combine(
    per_axis: Mapping[str, tuple[Candidate, ...]],
    infos: list[TensorInfo],
    outputs: tuple[TensorInfo | None, ...],
    mesh: Mapping[str, int],
) -> Iterable[Candidate | None]:
    """Products of the axes' candidates that cut no dim into more parts than it has."""
    sizes = list(mesh.values())
    for choice in itertools.product(*per_axis.values()):
        inputs = tuple(tuple(c.inputs[i][0] for c in choice) for i in range(len(infos)))
        outs = tuple(
            _sequential(tuple(c.outputs[j][0] for c in choice), sizes) if outputs[j] is not None else None
            for j in range(len(outputs))
        )
        valid = all(_fits(info, ps, sizes) for info, ps in zip(infos, inputs, strict=True))
        valid = valid and all(_fits(info, ps, sizes) for info, ps in zip(outputs, outs, strict=True) if info)
        sources = {c.source for c in choice}
        source = sources.pop() if len(sources) == 1 else "replicate" if "replicate" in sources else "dtensor"
        share = {axis: c.share[axis] for axis, c in zip(per_axis, choice, strict=True)}
        yield Candidate(inputs=inputs, outputs=outs, share=share, source=source) if valid else None


def _sequential(placements: Placements, sizes: Sequence[int]) -> Placements:
    """`placements` combined from one-axis answers, with each strided cut's split factor as DTensor counts
    it on the whole mesh: mesh axes cut a tensor one after the other, so a strided cut of a dim that earlier
    axes already cut splits the outer extent each device holds, not the whole one (a view flattening
    (batch, seq) cut S(0)|S(1) gives S(0)|_StridedShard(0, split_factor=batch / dp), where the tp axis alone
    answers split_factor=batch)."""
    out: list[Placement] = []
    before: dict[int, int] = defaultdict(
        lambda: 1
    )  # dim -> devices that plain cuts of earlier axes split it over
    for placement, size in zip(placements, sizes, strict=True):
        if _dtensor_rules.is_strided(placement):
            factor, cut = placement.split_factor, before[placement.dim]
            if cut > 1 and factor % cut == 0:
                placement = _dtensor_rules.strided(placement.dim, factor // cut)
        elif isinstance(placement, Shard):  # a strided cut after a strided cut keeps its factor
            before[placement.dim] *= size
        out.append(placement)
    return tuple(out)


def _fits(info: TensorInfo, placements: Placements, sizes: Sequence[int]) -> bool:
    """No dim is cut into more parts than it has, and the parts are even."""
    cuts = [1] * info.ndim
    for placement, size in zip(placements, sizes, strict=True):
        if _dtensor_rules.is_cut(placement):
            if placement.dim >= info.ndim:
                return False
            cuts[placement.dim] *= size
    return all(n % cut == 0 and n >= cut for n, cut in zip(info.shape, cuts, strict=True) if cut > 1)


def _fits_all(infos, outputs, ins, outs, size) -> bool:
    pairs = [*zip(infos, ins, strict=True), *((i, p) for i, p in zip(outputs, outs, strict=True) if i and p)]
    return all(_fits(info, (p,), [size]) for info, p in pairs)


# ---- helpers ----


def _checked_mesh(mesh: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(mesh, Mapping) or not mesh:
        raise ValueError(f"mesh = {mesh!r}: give axis sizes by name, e.g. {{'dp': 2, 'tp': 4}}")
    for axis, size in mesh.items():
        if not isinstance(axis, str) or isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {axis!r} = {size!r}: give each named axis a size >= 1")
    return dict(mesh)


def _standing_nodes(graph: Graph) -> list[str]:
    if graph.blocks is None:
        return [node.name for node in graph.ops()]
    blocks = graph.blocks
    keep = {*blocks.representative, *blocks.before, *blocks.between, *blocks.after}
    return [node.name for node in graph.ops() if node.name in keep]


def _short(placement: Placement) -> str:
    if _dtensor_rules.is_strided(placement):
        return f"S({placement.dim}/{placement.split_factor})"
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Partial):
        return "P"
    return "R" if isinstance(placement, Replicate) else repr(placement)
