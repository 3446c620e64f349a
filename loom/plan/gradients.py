"""Where a chosen plan's gradients move in backward, as DTensor moves them.

DTensor computes every backward operator on the gradient as it arrives. A consumer that read a tensor whole
while cutting its work along a mesh axis leaves a pending (`Partial`) gradient there
(`redistribute.gradient_layouts`); that gradient is not moved at its edge:

- the gradients of a tensor's readers are summed first (autograd accumulates them), so readers that leave
  the same layout cost one move, not one per reader; readers that leave different layouts are summed into
  the finest of them where each other one reaches it by cutting alone (a pending one reduce-scattered, a
  whole one sliced: DTensor's cheapest `add`), and the sum moves on once;
- an operator whose backward is linear in the gradient, with every other factor whole along the axis
  (a view, a sum, a product with a whole factor, `rsqrt`'s and `mean`'s backward: `LINEAR_IN_GRADIENT`),
  computes on the pending sum and passes it on to its own inputs' gradients (and to a parameter it reads:
  that gradient arrives pending, for `GradSync`'s buckets); one whose backward reads no saved tensor (a
  view, `mean`'s expand) passes it on whatever its forward cut, and one whose factor is cut along some
  pending axes moves it there only, passing the others on;
- the first operator that cannot take it pending moves it, straight from the pending layout to the layout
  of its output (`Partial -> Shard` a reduce-scatter where the output is cut, an all-reduce where whole);
- a gradient left cut finer than its producer's output (its one reader moved the tensor inside its
  dispatch, a free slice outside autograd) passes through a `POINTWISE` producer with whole factors as it
  is, DTensor slicing the saved factors: cut on where an input has the dim, pending where it is broadcast.

`gradient_flow` follows that over a solution's chosen layouts. It follows one instance of every repeated
block: a sum is modelled only between edges of the same instances (block 0's inner edges, or edges outside
the blocks, each instance's readers apart), where every edge and both its ends weigh alike; a pass reaches
the input edges of every instance, across a block boundary too (a second walk settles the edge of the
residual stream into block 0, which runs against the graph's order). The rules after the first were each
read off a `CommDebugMode` trace of a Llama step under a memory limit (docs/planner.md, "Not yet exact").
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard

from loom.plan.problem import carries_gradient, requirement
from loom.plan.redistribute import gradient_layouts
from loom.plan.space import Placements

__all__ = ["LINEAR_IN_GRADIENT", "GradientFlow", "gradient_flow", "pending_along"]

POINTWISE = frozenset({
    "aten.add.Tensor", "aten.sub.Tensor", "aten.neg.default", "aten.clone.default", "aten._to_copy.default",
    "aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar", "aten.rsqrt.default",
    "aten.pow.Tensor_Scalar",
})  # fmt: skip
"""Forward operators computed element by element (inputs broadcast to the output): DTensor runs their
backward on a gradient cut finer than their output by slicing the factors it saved, which costs nothing."""

LINEAR_IN_GRADIENT = POINTWISE | {"aten.mean.dim", "aten.sum.dim_IntList"}
"""Forward operators (besides views) whose backward multiplies the output gradient by factors made from the
forward's inputs and outputs, pointwise or by broadcasting and summing: DTensor's rules keep a pending
gradient pending through them when those factors are whole along its axis."""


@dataclass(frozen=True, kw_only=True)
class GradientFlow:
    """A solution's gradients in backward: `moves` maps an edge's id to the move its gradient makes there,
    (layout it arrives in, layout it is moved to), or None where nothing moves at that edge (its gradient
    is summed with another reader's and moved there, or carried on pending); `carried` maps an operator to
    the mesh axis indices along which its backward passes a pending gradient on."""

    moves: dict[int, tuple[Placements, Placements] | None]
    carried: dict[str, frozenset[int]]


def gradient_flow(solution: Any, skip: frozenset[int] = frozenset()) -> GradientFlow:
    """The gradient moves of `solution`'s chosen layouts (module notes), over the edges between operators
    that carry gradients; `skip` holds ids of edges whose gradient is predicted elsewhere (a parameter's
    views: `step._parameter_view_edges`). Edges from sources and into graph outputs keep their own move."""
    problem = solution.problem
    graph, decisions = problem.graph, problem.decisions
    position = {node.name: i for i, node in enumerate(graph.nodes)}
    readers: dict[Any, list] = defaultdict(list)
    for edge in problem.edges:
        if (
            id(edge) not in skip
            and decisions[edge.ref.node].kind == "op"
            and decisions[edge.target].kind == "op"
            and carries_gradient(graph, edge.ref, edge.target)
        ):
            readers[edge.ref].append(edge)
    arriving: dict[int, Placements] = {}  # edge id -> the pending gradient its consumer passed on
    # consumers first: a reader of the same instances comes after its producer in the graph; an edge into
    # block 0 from the block before (a residual stream) goes against that order: a second walk, from
    # what the first left arriving, settles it
    for _ in range(2):
        moves, carried = _walk(solution, readers, position, arriving, skip)
    return GradientFlow(moves=moves, carried=carried)


def _walk(solution: Any, readers: dict, position: dict, arriving: dict, skip: frozenset[int]) -> tuple:
    """One walk of `gradient_flow` over the producers, consumers first: the moves and the carried axes,
    and the pending gradients passed on, written into `arriving`."""
    problem = solution.problem
    moves: dict[int, tuple[Placements, Placements] | None] = {}
    carried: dict[str, frozenset[int]] = {}
    for ref in sorted(readers, key=lambda r: -position[r.node]):
        edges = readers[ref]
        wanted = _wanted(solution, edges[0])
        arrive = [arriving.get(id(e), _left(solution, e)) for e in edges]
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, edge in enumerate(edges):
            groups[_instance(problem, edge)].append(i)
        if len(groups) > 1:  # each instance's readers summed apart, each sum moved to the output's layout
            for members in groups.values():
                _sum_and_move(moves, [edges[i] for i in members], [arrive[i] for i in members], wanted)
            continue
        moved, summed, first = _summed(edges, arrive)
        if summed is None:
            _sum_and_move(moves, edges, arrive, wanted)
            continue
        moves.update(moved)
        # traced: a sum over several readers is moved to the output's layout before the producer's
        # backward (the residual stream's is gathered over tp before the residual `Add` passes it on)
        cut = _cut_passes(solution, ref, summed, wanted) if len(edges) == 1 else frozenset()
        if cut:
            for edge in _inputs(problem, ref.node, skip):
                arriving[id(edge)] = _cut_input(solution, edge, summed, cut)
            continue
        axes = _passes(solution, ref, summed, wanted)
        if not axes:
            moves[id(first)] = (summed, wanted)  # summed over the readers, moved once
            continue
        kept = pending_along(wanted, axes, over_cuts=True)  # moved where not passed on, pending where it is
        if kept != summed:
            moves[id(first)] = (summed, kept)
        carried[ref.node] = axes
        gradient_only = not problem.graph[ref.node].saved
        for edge in _inputs(problem, ref.node, skip):
            arriving[id(edge)] = pending_along(_left(solution, edge), axes, over_cuts=gradient_only)
    return moves, carried


def _cut_passes(solution: Any, ref: Any, arrived: Placements, wanted: Placements) -> frozenset[int]:
    """The mesh axes along which the gradient of `ref` arrived cut where its producer's output is whole
    (a reader of one module moved the tensor inside its dispatch, outside autograd, and left its gradient
    cut so), when the producer is `POINTWISE`, its work and inputs whole there, and the gradient arrived
    as its output along every other axis: DTensor runs the producer's backward on the cut gradient (it
    slices the saved factors) and passes the cut on to its inputs' gradients, moving nothing. Empty: not
    so."""
    problem = solution.problem
    node = problem.graph[ref.node]
    cut = frozenset(
        a for a, (p, w) in enumerate(zip(arrived, wanted, strict=True))
        if isinstance(p, Shard) and isinstance(w, Replicate)
    )  # fmt: skip
    if not cut or node.target not in POINTWISE or len([o for o in node.outputs if o is not None]) != 1:
        return frozenset()
    if any(arrived[a] != wanted[a] for a in range(len(wanted)) if a not in cut):
        return frozenset()
    candidate = solution.option(ref.node)
    return cut if all(_whole_along(candidate, problem.mesh, a) for a in cut) else frozenset()


def _cut_input(solution: Any, edge: Any, arrived: Placements, cut: frozenset[int]) -> Placements:
    """The gradient of input `edge` of a `POINTWISE` operator whose gradient `arrived` cut along `cut`
    (`_cut_passes`): cut along the same dim where the input has it, pending where the input is broadcast
    along that dim (its gradient is summed over it)."""
    out = solution.problem.graph[edge.target].output(0)
    shape = edge.tensor.shape
    left = list(_left(solution, edge))
    for a in cut:
        dim = arrived[a].dim - (len(out.shape) - len(shape))
        broadcast = dim < 0 or (shape[dim] == 1 and out.shape[arrived[a].dim] != 1)
        left[a] = Partial() if broadcast else Shard(dim)
    return tuple(left)


def _sum_and_move(moves: dict, edges: list, arrive: list, wanted: Placements) -> None:
    """Into `moves`: the gradients of `edges`, arrived as `arrive`, summed (`_summed`) and the sum moved to
    `wanted`; where `_summed` decides nothing, each moved on its own."""
    moved, summed, first = _summed(edges, arrive)
    if summed is None:
        moves.update({id(e): (a, wanted) for e, a in zip(edges, arrive, strict=True)})
        return
    moves.update(moved)
    moves[id(first)] = (summed, wanted)


def _summed(edges: list, arrive: list) -> tuple[dict, Placements | None, Any]:
    """How DTensor sums the gradients of a tensor's readers (`edges`) that `arrive` in their layouts: the
    moves before the sum (None where an edge's gradient moves no more at that edge), the layout of the
    sum and the edge that stands for it (where it moves on). All alike: summed as they are. Else, where
    one of them, whole or cut along every axis, takes each other one by cutting it (a pending one
    reduce-scattered, a whole one sliced), the others are moved to it (the least DTensor's sum can move);
    where none does, the layout of the sum is None and nothing is decided here."""
    if len(set(arrive)) == 1:
        return {id(e): None for e in edges}, arrive[0], edges[0]
    for summed in sorted(set(arrive), key=lambda a: -sum(isinstance(p, Shard) for p in a)):
        if all(_cuts_to(a, summed) for a in arrive):
            first = next(e for e, a in zip(edges, arrive, strict=True) if a == summed)
            moves = {id(e): (a, summed) if a != summed else None for e, a in zip(edges, arrive, strict=True)}
            return moves, summed, first
    return {}, None, edges[0]


def _cuts_to(arrived: Placements, summed: Placements) -> bool:
    """Whether `arrived` reaches `summed`, which holds no pending sum, by cutting alone along each axis
    where they differ."""
    return all(
        a == s or (isinstance(s, Shard) and isinstance(a, Partial | Replicate))
        for a, s in zip(arrived, summed, strict=True)
    ) and not any(isinstance(s, Partial) for s in summed)


def _left(solution: Any, edge: Any) -> Placements:
    """The layout the consumer's backward leaves the edge's gradient in (`gradient_layouts`)."""
    made, required, split = _ends(solution, edge)
    return gradient_layouts(made, required, split)[0]


def _wanted(solution: Any, edge: Any) -> Placements:
    """The layout the producer's backward takes the edge's gradient in: its output's, summed."""
    made, required, split = _ends(solution, edge)
    return gradient_layouts(made, required, split)[1]


def _ends(solution: Any, edge: Any) -> tuple[Placements, Placements, tuple]:
    problem = solution.problem
    producer = problem.decisions[edge.ref.node]
    picked = producer.options[solution.choice[edge.ref.node]]
    made = picked.outputs[edge.ref.index] if producer.kind == "op" else picked
    required, split = requirement(problem.decisions[edge.target], solution.choice[edge.target], edge.index,
                                  problem.mesh)  # fmt: skip
    return made, required, split


def pending_along(placements: Placements, axes: frozenset[int], over_cuts: bool = False) -> Placements:
    """`placements` pending along `axes` where whole (a pending gradient times whole factors stays pending),
    or along every one of `axes` with `over_cuts` (a backward that reads only the gradient, as `mean`'s
    expand, keeps it pending whatever the forward cut)."""
    return tuple(
        Partial() if a in axes and (over_cuts or isinstance(p, Replicate)) else p
        for a, p in enumerate(placements)
    )


def _instance(problem: Any, edge: Any) -> tuple[float, float, float]:
    """Which instances of the model an edge stands for: its weight and its two ends' (block 0's inner
    edges, the edges outside the blocks, and those across a block boundary differ)."""
    decisions = problem.decisions
    return (edge.weight, decisions[edge.ref.node].weight, decisions[edge.target].weight)


def _inputs(problem: Any, name: str, skip: frozenset[int]) -> list:
    """The edges into operator `name` that carry gradients back from an operator: every instance of `name`
    passes its gradient on alike, from inside its block or across a boundary."""
    return [
        e for e in problem.edges
        if e.target == name and id(e) not in skip and problem.decisions[e.ref.node].kind == "op"
        and carries_gradient(problem.graph, e.ref, e.target)
    ]  # fmt: skip


def _passes(solution: Any, ref: Any, arrived: Placements, wanted: Placements) -> frozenset[int]:
    """The mesh axes along which the producer of `ref` passes the pending gradient that `arrived` on, when
    the producer is linear in its gradient (`LINEAR_IN_GRADIENT` or a view) and the gradient arrived in the
    output's layout along every axis where it is not pending (else its backward moves it all at once):
    every pending axis where its backward reads only the gradient (no saved tensor: a view, `mean`, a sum),
    else those where the output is whole, and its work and every input too (the factors its backward
    multiplies by: `pow(x)` with x cut along one axis moves the gradient there and keeps the other axis
    pending). Empty: moved."""
    problem = solution.problem
    node = problem.graph[ref.node]
    pending = frozenset(
        a for a, (p, w) in enumerate(zip(arrived, wanted, strict=True))
        if isinstance(p, Partial) and not isinstance(w, Partial)
    )  # fmt: skip
    if not pending or len([o for o in node.outputs if o is not None]) != 1:
        return frozenset()
    if not (getattr(node.op, "is_view", False) or node.target in LINEAR_IN_GRADIENT):
        return frozenset()
    if any(arrived[a] != wanted[a] for a in range(len(wanted)) if a not in pending):
        return frozenset()
    if not node.saved:
        return pending
    candidate = solution.option(ref.node)
    return frozenset(
        a for a in pending if isinstance(wanted[a], Replicate) and _whole_along(candidate, problem.mesh, a)
    )


def _whole_along(candidate: Any, mesh: Any, axis: int) -> bool:
    """Whether `candidate` does all its work and reads every input whole along mesh axis index `axis`."""
    return candidate.share[list(mesh)[axis]] == 1 and all(
        ps is None or isinstance(ps[axis], Replicate) for ps in candidate.inputs
    )
