"""Placement rules of a region that runs on each rank's rows (loom's local regions: fused losses, experts,
attention): what its inputs are made and what its row sums are, shared by the runtime (`loom.parallel`) and the
planner's prediction of it (`loom.plan.step`)."""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

__all__ = ["cuts_classes", "pending_over_rows", "row_placements"]


def row_placements(placements: Sequence[Placement]) -> list[Placement]:
    """Rows (dim 0) stay cut where they are; every other placement becomes whole (gathered, summed)."""
    return [p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in placements]


def pending_over_rows(placements: Sequence[Placement]) -> list[Placement]:
    """What a sum over rows is, given the rows' placements: pending where the rows are cut."""
    return [Partial() if isinstance(p, Shard) else Replicate() for p in placements]


def cuts_classes(placements: Sequence[Placement], classes: int, sizes: Sequence[int]) -> bool:
    """Whether logits (rows, classes) laid out as `placements` on mesh dims of `sizes` have their classes
    cut evenly: the vocabulary-parallel cross entropy's case (an uneven cut is gathered instead)."""
    parts = 1
    for p, size in zip(placements, sizes, strict=True):
        if isinstance(p, Shard) and p.dim == 1:
            parts *= size
    return parts > 1 and classes % parts == 0
