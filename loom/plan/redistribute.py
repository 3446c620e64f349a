"""What moving a tensor from one layout to another costs on a mesh, priced by `loom.cost.collectives`.

A layout is DTensor placements, one per mesh axis (outermost first). Each axis whose placement changes
runs one collective over that axis's group, on the tensor as it is cut at that moment, axes changed in the
order DTensor's redistribution changes them (`dtensor_moves`):

| from -> to | collective |
| --- | --- |
| `Shard(i)` -> `Replicate` | all-gather |
| `Partial` -> `Replicate` | all-reduce |
| `Partial` -> `Shard(i)` | reduce-scatter |
| `Shard(i)` -> `Shard(j)` | all-to-all |
| `Shard(i)` -> `Partial` | all-gather (then a local zero-fill) |
| `Replicate` -> `Shard(i)` or `Partial` | nothing: each device keeps its slice (or its share of the sum) |
| `_StridedShard` -> anything, anything cut -> `_StridedShard` | all-gather (DTensor goes through `Replicate`) |
| `Partial` -> `_StridedShard` | all-reduce (then each device keeps its strided piece) |

A `_StridedShard` is DTensor's cut of a dim made by flattening a tensor cut along a later dim (a view of
labels cut along the sequence, `(4, 16) -> (64,)`): each device holds `1/size` of it like a `Shard`
(`is_cut`), but DTensor moves it only through a whole tensor, one axis at a time, never over a flattened
group. DTensor plans moves with one by its graph-based planner, which on the moves of one cut dim takes the
greedy order followed here (`tests/test_plan_solve.py` compares both).

Consecutive axes that run the same collective on the same change (`Shard(0)` -> `Replicate` on dp and on
tp; pending sums made whole on both) run it once, over the flattened group of those axes ("dp+tp"), as
DTensor merges them over the flattened meshes loom creates for every run of consecutive mesh axes
(`loom.dist.mesh`); all-to-alls are never merged.

DTensor also prices redistributions (`redistribute_cost`), with its own bandwidth constants; loom prices
them with its hardware profile (`loom.cost.hardware`), as the simulator prices every other collective.

Gradients flow back over the same edge: `gradient_layouts` gives the layout of an input's gradient as the
consumer's backward leaves it, and of an output's gradient as the producer's backward wants it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from loom.cost.collectives import GroupSpan, collective_time, group_span
from loom.cost.hardware import Cluster
from loom.plan._dtensor_rules import is_cut, is_strided
from loom.plan.space import Placements

__all__ = ["Step", "axis_spans", "dtensor_moves", "gradient_layouts", "redistribution"]


@dataclass(frozen=True, kw_only=True)
class Step:
    """One collective of a redistribution: `kind` over mesh `axis` (consecutive axes merged are joined by
    "+", as `loom.dist.comm.mesh_axes` names their group), on a buffer of `nbytes`, taking `seconds` (sizes
    as `loom.cost.collectives` counts them)."""

    axis: str
    kind: str
    nbytes: float
    seconds: float


def axis_spans(mesh: Mapping[str, int], cluster: Cluster) -> dict[str, GroupSpan]:
    """Where each mesh axis's groups sit: ranks are laid out with the last axis innermost, so an axis's
    members are spaced by the product of the sizes after it."""
    spans, stride = {}, 1
    for axis, size in reversed(list(mesh.items())):
        spans[axis] = group_span(size, stride, cluster.gpus_per_node)
        stride *= size
    return dict(reversed(list(spans.items())))


def redistribution(
    nbytes: float,
    source: Placements,
    target: Placements,
    mesh: Mapping[str, int],
    cluster: Cluster,
    spans: Mapping[str, GroupSpan] | None = None,
) -> list[Step]:
    """The collectives that move a tensor of `nbytes` (whole) from placements `source` to `target` on
    `mesh` (empty when nothing moves), in DTensor's order (`dtensor_moves`), consecutive axes of one
    change merged over their flattened group."""
    spans = axis_spans(mesh, cluster) if spans is None else spans
    sizes = list(mesh.values())
    current = list(source)
    runs: list[tuple[tuple, list[int], float]] = []  # (change, axis indices, bytes): one collective each
    for a, have, want in dtensor_moves(source, target, sizes):
        kind = _kind(have, want)
        if kind is not None:
            # all-gather and reduce-scatter count the gathered buffer, the others the local one.
            local = nbytes / _cuts(current, sizes)
            size = local * sizes[a] if kind == "all_gather" else local
            change = (kind, _merge_key(have), want)
            if runs and _merges(runs[-1], change, a):
                # a merged all-gather's output is the last gather's, a reduce-scatter's input the first's
                last = runs[-1]
                runs[-1] = (change, [*last[1], a], max(last[2], size))
            else:
                runs.append((change, [a], size))
        current[a] = want
    names = list(mesh)
    return [
        Step(
            axis="+".join(names[a] for a in sorted(axes)),
            kind=change[0],
            nbytes=size,
            seconds=collective_time(
                change[0], size, _span(sorted(axes), sizes, spans, names, cluster), cluster
            ),
        )
        for change, axes, size in runs
    ]


def dtensor_moves(
    source: Placements, target: Placements, sizes: Sequence[int]
) -> list[tuple[int, Placement, Placement]]:
    """The per-axis changes (axis index, from, to) DTensor's greedy redistribution makes, in its order
    (`torch.distributed.tensor._redistribute`, `generate_greedy_transform_infos`): when the source is cut
    at all, from the innermost axis out, each axis straight to its target, or whole first where a cut of
    the same tensor dim on an outer axis must change first (nested cuts, a strided cut changed to a plain
    one among them); then from the outermost axis in, whatever is left."""
    current, moves = list(source), []
    if _cuts(current, sizes) > 1:
        for a in reversed(range(len(sizes))):
            want = target[a]
            if isinstance(want, Shard):
                # the outer cuts of that dim, as they are and as they must be (a strided cut is not the
                # plain cut of the same dim: its pieces lie elsewhere)
                before = [(i, current[i]) for i in range(a) if _cuts_dim(current[i], want.dim)]
                after = [(i, target[i]) for i in range(a) if _cuts_dim(target[i], want.dim)]
                if before != after:
                    want = Replicate()
            if current[a] != want:
                moves.append((a, current[a], want))
                current[a] = want
    for a in range(len(sizes)):
        if current[a] != target[a]:
            moves.append((a, current[a], target[a]))
            current[a] = target[a]
    return moves


def _cuts_dim(placement: Placement, dim: int) -> bool:
    return is_cut(placement) and placement.dim == dim


# collectives DTensor merges over the flattened group of consecutive mesh axes (never its all-to-alls)
_MERGED = ("all_gather", "all_reduce", "reduce_scatter")


def _merges(run: tuple[tuple, list[int], float], change: tuple, axis: int) -> bool:
    """Whether DTensor runs `change` on `axis` in one collective with the run before it: the same change,
    on the next axis in its order (all-gathers inward-out, reduce-scatters outward-in, all-reduces
    either), over a group loom flattens (consecutive axes).

    A move from or to a `_StridedShard` never merges: DTensor runs it axis by axis.

    Not followed: DTensor does not flatten a reduce-scatter onto a tensor dim the flattened group does not
    divide evenly, and runs it axis by axis; the moves are priced from bytes alone (no shapes), so such a
    reduce-scatter is predicted as one collective where two run."""
    kind, (last_change, axes, _) = change[0], run
    if kind not in _MERGED or last_change != change or _strided(change):
        return False
    if kind == "all_gather":
        return axis == axes[-1] - 1
    if kind == "reduce_scatter":
        return axis == axes[-1] + 1
    return abs(axis - axes[-1]) == 1 and max(axes + [axis]) - min(axes + [axis]) == len(axes)


def _merge_key(have: Placement) -> object:
    """What must agree for two axes' collectives to merge: the source placement, a pending sum or mean
    alike (DTensor sums both and scales the mean after)."""
    return "partial" if isinstance(have, Partial) and have.reduce_op in ("sum", "avg") else have


def _span(
    axes: Sequence[int], sizes: Sequence[int], spans: Mapping[str, GroupSpan], names: Sequence[str], cluster
) -> GroupSpan:
    """The span of the group over consecutive mesh `axes` (ascending): one axis's own, or the flattened
    group's (its members spaced like the innermost axis's)."""
    if len(axes) == 1:
        return spans[names[axes[0]]]
    stride = math.prod(sizes[axes[-1] + 1 :])
    return group_span(math.prod(sizes[a] for a in axes), stride, cluster.gpus_per_node)


def _strided(change: tuple) -> bool:
    """Whether a change (kind, source key, target) moves from or to a `_StridedShard`."""
    return is_strided(change[1]) or is_strided(change[2])


def _kind(have: Placement, want: Placement) -> str | None:
    if have == want or isinstance(have, Replicate):
        return None
    if isinstance(have, Partial):
        if is_strided(want):  # summed whole first (DTensor's `_reduce_value`), then each keeps its piece
            return "all_reduce"
        return (
            "reduce_scatter"
            if isinstance(want, Shard)
            else None
            if isinstance(want, Partial)
            else "all_reduce"
        )
    if is_strided(have) or is_strided(want):
        return "all_gather"  # DTensor goes through a whole tensor, then keeps the piece wanted
    return "all_to_all" if isinstance(want, Shard) else "all_gather"


def _cuts(placements: Sequence[Placement], sizes: Sequence[int]) -> int:
    return math.prod(size for p, size in zip(placements, sizes, strict=True) if is_cut(p))


def gradient_layouts(
    output: Placements, required: Placements, split: Sequence[bool]
) -> tuple[Placements, Placements]:
    """The gradient's way back over an edge whose producer made `output` and whose consumer read it as
    `required`, its work cut along the axes marked in `split`: (the layout the consumer's backward leaves
    the gradient in, the layout the producer's backward needs it in).

    A consumer that reads a whole (`Replicate`) tensor while cutting its own work along an axis leaves a
    partial gradient there (a column-parallel matmul's input gradient; a data-parallel weight's gradient);
    a cut input has a cut gradient and a partial-sum input a whole one. The producer wants the gradient cut
    as its output was, and whole for a whole or partial output."""
    left = tuple(
        Partial() if isinstance(p, Replicate) and cut else Replicate() if isinstance(p, Partial) else p
        for p, cut in zip(required, split, strict=True)
    )
    wanted = tuple(Replicate() if isinstance(p, Partial) else p for p in output)
    return left, wanted
