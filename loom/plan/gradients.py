"""Where a chosen plan's gradients move in backward, as DTensor moves them.

DTensor computes every backward operator on the gradient as it arrives. A consumer that read a tensor whole
while cutting its work along a mesh axis leaves a pending (`Partial`) gradient there
(`redistribute.gradient_layouts`); that gradient is not moved at its edge:

- the gradients of a tensor's readers are summed first (autograd accumulates them), so readers that leave
  the same layout cost one move, not one per reader;
- an operator whose backward is linear in the gradient, with every other factor whole along the axis
  (a view, a sum, a product with a whole factor, `rsqrt`'s and `mean`'s backward: `LINEAR_IN_GRADIENT`),
  computes on the pending sum and passes it on to its own inputs' gradients (and to a parameter it reads:
  that gradient arrives pending, for `GradSync`'s buckets);
- the first operator that cannot take it pending moves it, straight from the pending layout to the layout
  of its output (`Partial -> Shard` a reduce-scatter where the output is cut, an all-reduce where whole).

`gradient_flow` follows that over a solution's chosen layouts. It follows one instance of every repeated
block: a sum or a pass is modelled only between edges of the same instances (block 0's inner edges, or
edges outside the blocks), where every edge and both its ends weigh alike; a tensor read across a block
boundary is moved at each reading edge, as before.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Partial, Replicate

from loom.plan.problem import carries_gradient, requirement
from loom.plan.redistribute import gradient_layouts
from loom.plan.space import Placements

__all__ = ["LINEAR_IN_GRADIENT", "GradientFlow", "gradient_flow", "pending_along"]

LINEAR_IN_GRADIENT = frozenset({
    "aten.add.Tensor", "aten.sub.Tensor", "aten.neg.default", "aten.clone.default", "aten._to_copy.default",
    "aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar",
    "aten.rsqrt.default", "aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.sum.dim_IntList",
})  # fmt: skip
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
    moves: dict[int, tuple[Placements, Placements] | None] = {}
    carried: dict[str, frozenset[int]] = {}
    # consumers first: a reader of the same instances comes after its producer in the graph
    for ref in sorted(readers, key=lambda r: -position[r.node]):
        edges = readers[ref]
        wanted = _wanted(solution, edges[0])
        arrive = [arriving.get(id(e), _left(solution, e)) for e in edges]
        if len({_instance(problem, e) for e in edges}) > 1 or len(set(arrive)) > 1:
            moves.update({id(e): (a, wanted) for e, a in zip(edges, arrive, strict=True)})
            continue
        moves.update({id(e): None for e in edges})
        axes = _passes(solution, ref, arrive[0], wanted)
        if not axes:
            moves[id(edges[0])] = (arrive[0], wanted)  # summed over the readers, moved once
            continue
        carried[ref.node] = axes
        for edge in _inputs(problem, ref.node, skip):
            arriving[id(edge)] = pending_along(_left(solution, edge), axes)
    return GradientFlow(moves=moves, carried=carried)


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


def pending_along(placements: Placements, axes: frozenset[int]) -> Placements:
    """`placements` pending along `axes` where whole (a pending gradient times whole factors stays pending)."""
    return tuple(Partial() if a in axes and isinstance(p, Replicate) else p for a, p in enumerate(placements))


def _instance(problem: Any, edge: Any) -> tuple[float, float, float]:
    """Which instances of the model an edge stands for: its weight and its two ends' (block 0's inner
    edges, the edges outside the blocks, and those across a block boundary differ)."""
    decisions = problem.decisions
    return (edge.weight, decisions[edge.ref.node].weight, decisions[edge.target].weight)


def _inputs(problem: Any, name: str, skip: frozenset[int]) -> list:
    """The edges into operator `name` that carry gradients back, from an operator of the same instances."""
    weight = problem.decisions[name].weight
    return [
        e for e in problem.edges
        if e.target == name and id(e) not in skip and problem.decisions[e.ref.node].kind == "op"
        and e.weight == weight == problem.decisions[e.ref.node].weight
        and carries_gradient(problem.graph, e.ref, e.target)
    ]  # fmt: skip


def _passes(solution: Any, ref: Any, arrived: Placements, wanted: Placements) -> frozenset[int]:
    """The mesh axes along which the producer of `ref` passes the pending gradient that `arrived` on: those
    where it arrived pending and the output is whole, when the producer is linear in its gradient
    (`LINEAR_IN_GRADIENT` or a view), its work and every input whole there, and the gradient arrived in
    the output's layout along every other axis (else its backward moves it all at once). Empty: moved."""
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
    candidate = solution.option(ref.node)
    axes = list(problem.mesh)
    for a in pending:
        whole = isinstance(wanted[a], Replicate) and candidate.share[axes[a]] == 1
        if not whole or any(ps is not None and not isinstance(ps[a], Replicate) for ps in candidate.inputs):
            return frozenset()
    return pending
