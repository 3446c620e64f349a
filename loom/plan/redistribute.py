"""What moving a tensor from one layout to another costs on a mesh, priced by `loom.cost.collectives`.

A layout is DTensor placements, one per mesh axis (outermost first). Each axis whose placement changes
runs one collective over that axis's group, on the tensor as it is cut at that moment (axes are changed in
order, outermost first, as DTensor's redistribution does):

| from -> to | collective |
| --- | --- |
| `Shard(i)` -> `Replicate` | all-gather |
| `Partial` -> `Replicate` | all-reduce |
| `Partial` -> `Shard(i)` | reduce-scatter |
| `Shard(i)` -> `Shard(j)` | all-to-all |
| `Shard(i)` -> `Partial` | all-gather (then a local zero-fill) |
| `Replicate` -> `Shard(i)` or `Partial` | nothing: each device keeps its slice (or its share of the sum) |

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
from loom.plan.space import Placements

__all__ = ["Step", "axis_spans", "gradient_layouts", "redistribution"]


@dataclass(frozen=True, kw_only=True)
class Step:
    """One collective of a redistribution: `kind` over mesh `axis`, on a buffer of `nbytes`, taking
    `seconds` (sizes as `loom.cost.collectives` counts them)."""

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
    `mesh` (empty when nothing moves)."""
    spans = axis_spans(mesh, cluster) if spans is None else spans
    sizes = list(mesh.values())
    current = list(source)
    steps = []
    for a, axis in enumerate(mesh):
        kind = _kind(current[a], target[a])
        if kind is not None:
            # all-gather and reduce-scatter count the gathered buffer, the others the local one.
            local = nbytes / _cuts(current, sizes)
            size = local * sizes[a] if kind == "all_gather" else local
            steps.append(
                Step(
                    axis=axis,
                    kind=kind,
                    nbytes=size,
                    seconds=collective_time(kind, size, spans[axis], cluster),
                )
            )
        current[a] = target[a]
    return steps


def _kind(have: Placement, want: Placement) -> str | None:
    if have == want or isinstance(have, Replicate):
        return None
    if isinstance(have, Partial):
        return (
            "reduce_scatter"
            if isinstance(want, Shard)
            else None
            if isinstance(want, Partial)
            else "all_reduce"
        )
    return "all_to_all" if isinstance(want, Shard) else "all_gather"


def _cuts(placements: Sequence[Placement], sizes: Sequence[int]) -> int:
    return math.prod(size for p, size in zip(placements, sizes, strict=True) if isinstance(p, Shard))


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
